"""What Allocate gets from CDI: the catalog of what the spec files on disk define, and the
CDI names in its answers.

The CDI sync (:mod:`devplug.cdi.sync`) records each spec it writes in the
:class:`CdiCatalog`; Allocate, on the event loop, names only devices the spec on disk defines
as they are now, and confirms with an lstat that the file is still the one written. The
kubelet front takes :class:`CdiNames` through a protocol of its own
(``devplug.kubelet.seams.AnswerExtension``).

For runtimes that predate CDI fields in the CRI, the names can also go into the Kubernetes
annotation ``cdi.k8s.io/<plugin>_<device>``: the part after the prefix is at most 63
characters of letters, digits, ``_``, ``-`` and ``.``, starting and ending with a letter or
digit.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from devplug.cdi.spec import qualified_name
from devplug.cdi.stamps import FileStamp, file_stamp
from devplug.errors import CdiSpecError
from devplug.model import ContainerAllocation, DeviceInfo, MapEdit

log = structlog.get_logger(__name__)

# The plugin part of devplug's cdi.k8s.io/<plugin>_<resource> annotation keys.
ANNOTATION_PLUGIN = "devplug"
ANNOTATION_PREFIX = "cdi.k8s.io/"
MAX_ANNOTATION_NAME = 63
_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")


# How long a confirm's lstat stands while the CDI dir watch reports nothing: some changes raise
# no event in the dir (a mount over it, a write through a hard link elsewhere), and those must
# not leave a stale name in answers, and its spec unrepaired, for ever.
CONFIRM_MAX_AGE_S = 1.0


@dataclass(frozen=True, slots=True, eq=False)
class CdiResource:
    """What the spec file of one resource on disk defines."""

    kind: str
    file_name: str
    names: frozenset[str]
    # The devices the file was made from: a device whose nodes, mounts or CDI edits changed since
    # is not named in Allocate until its spec is rewritten (the runtime would inject the old).
    devices: Mapping[str, DeviceInfo]
    # The file as written (None: not checked), so Allocate can confirm it is still there.
    path: Path | None = None
    stamp: FileStamp | None = None

    def narrowed_to(
        self, devices: Mapping[str, DeviceInfo], edit: MapEdit | None = None
    ) -> CdiResource:
        """This entry, naming only the devices whose DeviceInfo is the very one in
        ``devices`` too: what a file being replaced defines before and after alike. ``edit``:
        how ``devices`` was made from a map; when that is the one this file was made from, only
        the ids it edited can differ (no pass over every name, on the event loop)."""
        if edit is not None and edit.base is self.devices:
            return replace(self, names=self.names - edit.removed - edit.added)
        same = frozenset(name for name in self.names if devices.get(name) is self.devices.get(name))
        return replace(self, names=same)

    def defines(self, device_id: str, now: DeviceInfo) -> bool:
        """Whether the spec on disk gives ``device_id`` what ``now`` says it should get."""
        if device_id not in self.names:
            return False
        then = self.devices.get(device_id)
        return then is now or (
            then is not None
            and then.nodes == now.nodes
            and then.mounts == now.mounts
            and then.cdi_edits == now.cdi_edits
        )


class CdiCatalog:
    """resource -> what its spec on disk defines; read by Allocate on the event loop."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._resources: dict[str, CdiResource] = {}
        # Told whenever an entry changes (the daemon's stats).
        self._on_change = on_change
        # Bumped on every change, so cached Allocate answers know when they are stale.
        self.generation = 0
        # Called when Allocate finds a spec gone or replaced behind devplug's back.
        self.on_stale: Callable[[str], None] | None = None
        # The CDI dir watch's token (DirWatcher.token), once a watch follows the dir.
        self._dir_token: Callable[[], int | None] | None = None
        # resource -> (its entry, the dir token, until when) after an lstat found its file.
        self._confirmed: dict[str, tuple[CdiResource, int, float]] = {}

    @property
    def dir_token(self) -> Callable[[], int | None] | None:
        return self._dir_token

    @dir_token.setter
    def dir_token(self, token: Callable[[], int | None] | None) -> None:
        # Another watch counts from its own start: no confirmation made under one stands.
        self._dir_token = token
        self._confirmed.clear()

    def resources(self) -> list[str]:
        """The resources whose spec is on disk (for status and tests)."""
        return sorted(self._resources)

    def confirm(self, resource: str) -> None:
        """Drop ``resource``'s entry if its file is no longer the one written (deleted, or
        replaced by someone else), so that no name the runtime cannot resolve is sent.

        An lstat, on the event loop (the CDI dir is a tmpfs, /var/run/cdi, or a local dir: a
        stale name would fail the container), unless the dir watch has seen no change since
        an lstat that found the file less than CONFIRM_MAX_AGE_S ago: nothing can have
        happened to it then but in the events the event loop has yet to read, or in the rare
        changes no event of the dir tells of. (On a just-woken CPU that lstat is a tenth of an
        Allocate's own time.)
        """
        entry = self._resources.get(resource)
        if entry is None or entry.path is None:
            return
        token = self._dir_token() if self._dir_token is not None else None
        if token is not None:
            seen = self._confirmed.get(resource)
            if (
                seen is not None
                and seen[0] is entry
                and seen[1] == token
                and time.monotonic() < seen[2]
            ):
                return
        if file_stamp(entry.path) == entry.stamp:
            if token is not None:
                self._confirmed[resource] = (entry, token, time.monotonic() + CONFIRM_MAX_AGE_S)
            return
        log.warning("cdi.spec.vanished", resource=resource, file=str(entry.path))
        self.set(resource, None)
        if self.on_stale is not None:
            self.on_stale(resource)

    def get(self, resource: str) -> CdiResource | None:
        return self._resources.get(resource)

    def set(self, resource: str, value: CdiResource | None) -> None:
        if self._resources.get(resource) is value:
            return
        if value is None:
            self._resources.pop(resource, None)
            self._confirmed.pop(resource, None)
        else:
            self._resources[resource] = value
        self.generation += 1
        if self._on_change is not None:
            self._on_change()


# ------------------------------------------------------------------------- answers


def annotation_key(plugin: str, device: str) -> str:
    """``cdi.k8s.io/<plugin>_<device>`` following the CDI library's AnnotationKey rules.

    Characters the rules refuse (":" in PCI-address ids, "/" in resource names) become "_";
    a name longer than 63 characters keeps a prefix and a hash, so keys stay distinct.
    """
    raw = f"{plugin}_{device}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", raw).strip("_.-")
    if len(name) > MAX_ANNOTATION_NAME or not name:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
        prefix = name[: MAX_ANNOTATION_NAME - len(digest) - 1].rstrip("_.-")
        name = f"{prefix}_{digest}" if prefix else f"h{digest}"
    if not _ANNOTATION_NAME.match(name):
        raise CdiSpecError(f"cannot make a CDI annotation key from {raw!r}")
    return ANNOTATION_PREFIX + name


@dataclass(frozen=True, slots=True)
class CdiOptions:
    catalog: CdiCatalog
    annotations: bool  # also name the devices in a cdi.k8s.io/ annotation
    device_specs: bool  # keep nodes, mounts and env beside the CDI names


def with_cdi(
    resource: str,
    ids: Sequence[str],
    answer: ContainerAllocation,
    options: CdiOptions,
    devices: Mapping[str, DeviceInfo],
    *,
    may_strip: bool = True,
) -> ContainerAllocation:
    """``answer`` plus the CDI names of ``ids`` that the resource's spec on disk defines as
    they are now (``devices``: the advertised devices).

    Applied to the default answer, which is made from the same devices as the spec (an
    Allocator hook's answer is the hook's own and is sent as it is). Without ``device_specs``,
    the nodes and mounts are dropped only when every id has a CDI name (and ``may_strip``): a
    device the spec does not define yet (written a moment later, or not at all on a read-only
    dir) still reaches the container through its device specs. Env always stays: specs do
    not carry it.
    """
    entry = options.catalog.get(resource)
    if entry is None:
        return answer
    names = tuple(qualified_name(entry.kind, i) for i in ids if entry.defines(i, devices[i]))
    if not names:
        return answer
    annotations = dict(answer.annotations)
    if options.annotations:
        annotations[annotation_key(ANNOTATION_PLUGIN, resource)] = ",".join(names)
    strip = may_strip and not options.device_specs and len(names) == len(ids)
    return ContainerAllocation(
        env=answer.env,  # never in the spec: see devplug.cdi.render.device_edits
        mounts=() if strip else answer.mounts,
        nodes=() if strip else answer.nodes,
        annotations=annotations,
        cdi_devices=tuple(dict.fromkeys((*answer.cdi_devices, *names))),
    )


class CdiNames:
    """CDI names in the kubelet front's default Allocate answers (it takes any object of this
    shape: ``devplug.kubelet.seams.AnswerExtension``)."""

    def __init__(self, options: CdiOptions) -> None:
        self.options = options

    @property
    def generation(self) -> int:
        return self.options.catalog.generation

    def confirm(self, resource: str) -> None:
        self.options.catalog.confirm(resource)  # never name a spec that is gone

    def extend(
        self,
        resource: str,
        ids: Sequence[str],
        answer: ContainerAllocation,
        devices: Mapping[str, DeviceInfo],
    ) -> ContainerAllocation:
        return with_cdi(resource, ids, answer, self.options, devices)

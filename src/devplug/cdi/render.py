"""From a resource's advertised devices to its CDI spec: the kind and device names devplug
gives them, each device's container edits, and the spec file's bytes (no files written; each
device node's mode and group are read from the host node, an lstat, when its device is
rendered)."""

from __future__ import annotations

import bisect
import heapq
import os
import stat
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from devplug.cdi.spec import (
    MAX_FILE_MODE,
    ContainerEdits,
    DeviceNodeEdit,
    HookEdit,
    MountEdit,
    Spec,
    SpecDevice,
    assemble_spec_json,
    compact_json,
    device_document,
    device_name_problem,
    device_problems,
    device_version,
    head_problems,
    head_version,
    later_version,
    parse_kind,
)
from devplug.errors import CdiSpecError
from devplug.model import DeviceInfo, DeviceNode, MapEdit
from devplug.naming import NaturalKey, device_id_problem, natural_key

# Told by a render in slices whether its slice is used up (True: yield to the caller now).
Due = Callable[[], bool]
# Ids sorted at once (a run), before the runs are merged: a slice of work each.
SORT_RUN = 256
# A render edits its last one in place for at most this many changed ids, or an eighth of the
# devices if more; past that it renders them all (reusing each unchanged device's fragment).
EDITED_AT_MOST = 64


def default_kind(resource: str) -> str:
    """The kind for a resource: the resource name itself when it is a valid kind (as
    ``gpu.intel.com/i915`` is). A vendor or class that starts with a digit, or is a single
    character (both allowed in resource names, not in kinds), gets an ``x`` in front:
    ``3d.example.com/cam`` -> ``x3d.example.com/cam``, ``example.com/a`` -> ``example.com/xa``.
    Resource names hold no other character a kind refuses."""
    vendor, _, cls = resource.partition("/")
    fixed = "/".join(
        part if part[:1].isalpha() and len(part) > 1 else "x" + part for part in (vendor, cls)
    )
    parse_kind(fixed)
    return fixed


def cdi_device_name(device_id: str) -> str:
    """The CDI device name of a device id: the id itself.

    Device ids are checked against the CDI device-name alphabet when a tree is built
    (:func:`devplug.naming.device_id_problem`), so this never has to map anything; it raises
    rather than invent a name if that ever stops being true.
    """
    problem = device_id_problem(device_id) or device_name_problem(device_id)
    if problem is not None:
        raise CdiSpecError(f"device id {device_id!r} is not a CDI device name: {problem}")
    return device_id


def _never() -> bool:
    return False


class HostAccess(NamedTuple):
    """Who may use a host device node: its permission bits and its group."""

    mode: int
    gid: int


def host_access(path: str) -> HostAccess | None:
    """The access of the device node at ``path`` as it is now, or None when ``path`` is not a
    character or block device (gone, say). ``path`` is a DeviceNode's host path, validated
    when the node was made (absolute, normalised, no NUL); it is lstat'ed, never opened or
    followed, as the runtime does when it fills in the node's type and numbers."""
    try:
        info = os.lstat(path)
    except (OSError, ValueError):
        return None
    if not (stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)):
        return None
    return HostAccess(stat.S_IMODE(info.st_mode) & MAX_FILE_MODE, info.st_gid)


def _node_edit(node: DeviceNode) -> DeviceNodeEdit:
    """One node of the spec, with the host node's mode and group.

    runc makes a node the OCI spec gives no mode 0666 and the CDI library fills in only type
    and numbers, so without ``fileMode`` a 0600 host node would be open to every user of the
    container. The group is carried too: a root:render 0660 node then grants the container's
    members of that group what it grants them on the host (as podman's --device, containerd
    and CRI-O do for device specs); without it the library gives the node the process's own
    group, or root's, and the group's access goes to others. The owner is not carried: for
    an absent uid the library gives the node to a non-root container's user (the one the
    device was allocated to, as containerd's device_ownership_from_security_context does),
    and to root otherwise, which owns device nodes on the host; a host uid would lock a
    non-root container out of its own 0600 node.

    A node that is not there (its device going away between scan and render) gets neither:
    runtimes refuse to inject a host node they cannot stat, and the uevent that brings a node
    back has its device re-read and so rendered again, with the node's access."""
    access = host_access(node.host_path)
    return DeviceNodeEdit(
        path=node.container_path,
        # Left out when equal, so the spec needs no newer cdiVersion than it must.
        host_path=None if node.host_path == node.container_path else node.host_path,
        permissions=node.permissions,
        file_mode=None if access is None else access.mode,
        gid=None if access is None else access.gid,
    )


def device_edits(info: DeviceInfo) -> ContainerEdits:
    """What a container gets for one device from its spec: nodes, mounts and CDI-only edits."""
    nodes = tuple(_node_edit(node) for node in info.nodes)
    mounts = tuple(
        MountEdit(
            host_path=mount.host_path,
            container_path=mount.container_path,
            options=("ro" if mount.read_only else "rw", "nosuid", "nodev", "bind"),
        )
        for mount in info.mounts
    )
    hooks: tuple[HookEdit, ...] = ()
    gids: tuple[int, ...] = ()
    if info.cdi_edits is not None:
        hooks = tuple(
            HookEdit(h.hook_name, h.path, h.args, h.env, h.timeout) for h in info.cdi_edits.hooks
        )
        gids = info.cdi_edits.additional_gids
    # No env: Allocate carries it. The kubelet merges the env of all of a container's devices
    # (KubeVirt's PCI_RESOURCE_* lists every group), while CDI injection sets each device's
    # variables in turn, so the last device's value would win over the merged one.
    return ContainerEdits(
        device_nodes=nodes,
        mounts=mounts,
        hooks=hooks,
        additional_gids=gids,
    )


def resource_spec(kind: str, devices: Mapping[str, DeviceInfo]) -> Spec | None:
    """The spec of ``devices`` under ``kind`` as a model, or None when no device has anything
    to put in a container (the CDI library refuses devices with empty edits and specs
    without devices). Built by :class:`SpecRenderer`, the one spec builder.

    The spec carries nothing but its devices: no annotations of devplug's own, which would
    raise its cdiVersion to 0.6.0, a version CDI libraries before 0.6 (Debian 12's podman,
    containerd 1.7, CRI-O 1.27) refuse whole. Ownership is kept in
    :mod:`devplug.cdi.ownership` instead."""
    renderer = SpecRenderer(kind)
    if renderer.render(devices) is None:
        return None
    return Spec(kind=kind, devices=renderer.spec_devices())


@dataclass(frozen=True, slots=True)
class RenderedSpec:
    data: bytes  # the file's bytes: spec_json() of the same devices gives exactly these
    names: frozenset[str]  # the device names the spec defines


# The steps of a render in slices: each next() does a slice; the render's result at the end.
RenderSteps = Generator[None, None, RenderedSpec | None]


class _Made(NamedTuple):
    """One device as the renderer last made it."""

    info: DeviceInfo  # the object it was made from: reused while the tree shares it
    device: SpecDevice | None  # None: nothing to put in a container
    fragment: bytes  # compact_json(device_document(device)); empty when device is None
    version: str  # the lowest cdiVersion the device needs


_T = TypeVar("_T")


def finish(steps: Generator[None, None, _T]) -> _T:
    """Run a render's ``steps`` to the end, without pausing; what they return."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: _T = done.value
            return result


class SpecRenderer:
    """Renders one resource's spec file, reusing each unchanged device's validated JSON.

    Devices are listed in natural id order, so the file is stable; devices with nothing to put
    in a container are left out. A hotplug event changes one device of thousands; rebuilding,
    validating and serialising all of them on every change would cost tens of milliseconds of
    CPU that compete with the RPCs. A device's fragment is kept while its DeviceInfo is the same
    object (trees share unchanged devices' objects). Given the edit that made the map from the
    one rendered last (:meth:`DeviceTree.edit_since`), only the edited ids are looked at: the
    work is O(changed) but for joining the fragments into the file's bytes. Not thread-safe:
    one renderer per resource, used by one thread at a time.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        problems = head_problems(kind, {}, None)
        if problems:
            raise CdiSpecError(f"invalid CDI spec for kind {kind!r}: {'; '.join(problems)}")
        self._head_version = head_version(kind, {}, None)
        self._made: dict[str, _Made] = {}
        # The ids of the last render in file order and their fragments (empty for devices left
        # out); reused while the set of ids is the same (a natural sort of 10,000 ids costs
        # ~20 ms) and edited in place after an edit (found by bisect on natural keys).
        self._order: list[str] = []
        self._fragments: list[bytes] = []
        self._versions: Counter[str] = Counter()  # of the devices in the file
        self._names: set[str] = set()  # the ids of the devices in the file
        # The map rendered last (None: unknown, after a failed render).
        self.rendered: Mapping[str, DeviceInfo] | None = None

    def render(
        self, devices: Mapping[str, DeviceInfo], edit: MapEdit | None = None
    ) -> RenderedSpec | None:
        """The spec of ``devices``, or None when no device has anything to give. ``edit``: how
        ``devices`` was made from the map rendered last, if known."""
        return finish(self.render_steps(devices, edit, _never))

    def render_steps(
        self, devices: Mapping[str, DeviceInfo], edit: MapEdit | None, due: Due
    ) -> RenderSteps:
        """:meth:`render` in slices, for the event loop: it yields whenever ``due()`` says its
        slice is used up, and returns the same result. A first render of 10,000 devices is
        ~0.2 s of CPU; in a worker thread it would hold the GIL against the hotplug path's own
        thread and loop for switch intervals at a time, in slices the hotplug path waits for
        one slice at most. The renderer's state changes only in a final step that does not
        yield: abandoned between slices, it is as before, but for :attr:`rendered` (None:
        the next render looks at every device, reusing the fragments made so far)."""
        last, self.rendered = self.rendered, None  # until this render succeeds
        if last is not None and (edit is None or edit.base is not last):
            # The CDI sync takes the latest tree of a burst: its edit is from a tree it
            # skipped (a GPU's minors, then the GPU, in two coalescing windows). The maps'
            # difference costs a pass of identity checks; a render of all would sort every
            # id again (~120 ms of CPU at 10,000 devices on a busy machine).
            edit = yield from _edit_between(last, devices, due)
            if len(edit.added) > max(len(devices) // 8, EDITED_AT_MOST):
                # Many devices made anew (a full scan): edited in place, each would be found
                # by a bisect in the last step, which does not yield (~0.4 s at 10,000).
                edit = None
        if edit is not None and last is not None:
            yield from self._apply(devices, edit, due)
        else:
            yield from self._render_all(devices, due)
        self.rendered = devices
        if not self._names:
            return None
        version = later_version(self._head_version, *self._versions)
        if len(self._names) == len(self._fragments):
            fragments = self._fragments
        else:
            fragments = [fragment for fragment in self._fragments if fragment]
        data = assemble_spec_json(self.kind, {}, version, fragments)
        return RenderedSpec(data, frozenset(self._names))

    def spec_devices(self) -> tuple[SpecDevice, ...]:
        """The devices of the last render's spec, in file order."""
        made = (self._made[device_id] for device_id in self._order)
        return tuple(m.device for m in made if m.device is not None)

    def _render_all(
        self, devices: Mapping[str, DeviceInfo], due: Due
    ) -> Generator[None, None, None]:
        made: dict[str, _Made] = {}
        edits_of: dict[int, ContainerEdits] = {}  # shares of one device have one DeviceInfo
        order = self._order
        if len(order) != len(devices) or not all(i in devices for i in order):
            order = yield from _natural_order(devices, due)
        fragments: list[bytes] = []
        versions: Counter[str] = Counter()
        names: set[str] = set()
        for device_id in order:
            info = devices[device_id]
            cached = self._made.get(device_id)
            if cached is None or cached.info is not info:
                cached = self._make(device_id, info, edits_of)
                if due():
                    yield
            made[device_id] = cached
            fragments.append(cached.fragment)
            if cached.device is not None:
                versions[cached.version] += 1
                names.add(device_id)
        # The state changes here only, after the last slice.
        self._made, self._order = made, order
        self._fragments, self._versions, self._names = fragments, versions, names

    def _apply(
        self, devices: Mapping[str, DeviceInfo], edit: MapEdit, due: Due
    ) -> Generator[None, None, None]:
        """The last render's state, edited: the ids ``edit`` took out go, the ids it put in
        are made (first, in slices, so that an invalid device or an abandoned render changes
        nothing) and take their place (one step: bisects and list edits)."""
        edits_of: dict[int, ContainerEdits] = {}
        new: dict[str, _Made] = {}
        for device_id in edit.added:
            info = devices[device_id]
            cached = self._made.get(device_id)
            if cached is None or cached.info is not info:
                cached = self._make(device_id, info, edits_of)
                if due():
                    yield
            new[device_id] = cached
        for device_id in edit.removed - edit.added:
            old = self._made.pop(device_id, None)
            if old is None:
                continue
            index = self._index(device_id)
            del self._order[index], self._fragments[index]
            self._forget(device_id, old)
        for device_id, made in new.items():
            old = self._made.get(device_id)
            self._made[device_id] = made
            if old is None:
                index = bisect.bisect_left(self._order, natural_key(device_id), key=natural_key)
                self._order.insert(index, device_id)
                self._fragments.insert(index, made.fragment)
            else:
                self._fragments[self._index(device_id)] = made.fragment
                self._forget(device_id, old)
            if made.device is not None:
                self._versions[made.version] += 1
                self._names.add(device_id)

    def _index(self, device_id: str) -> int:
        index = bisect.bisect_left(self._order, natural_key(device_id), key=natural_key)
        if self._order[index] != device_id:  # unreachable: the state describes the base
            raise RuntimeError(f"renderer out of step at {device_id!r}")
        return index

    def _forget(self, device_id: str, old: _Made) -> None:
        if old.device is not None:
            self._versions[old.version] -= 1
            if not self._versions[old.version]:
                del self._versions[old.version]
            self._names.discard(device_id)

    @staticmethod
    def _make(device_id: str, info: DeviceInfo, edits_of: dict[int, ContainerEdits]) -> _Made:
        edits = edits_of.get(id(info))
        if edits is None:
            edits = edits_of[id(info)] = device_edits(info)
        if edits.empty:
            return _Made(info, None, b"", "")
        device = SpecDevice(cdi_device_name(device_id), edits)
        problems = device_problems(device)
        if problems:
            raise CdiSpecError(f"invalid CDI device {device_id!r}: {'; '.join(problems)}")
        return _Made(info, device, compact_json(device_document(device)), device_version(device))


def _edit_between(
    base: Mapping[str, DeviceInfo], devices: Mapping[str, DeviceInfo], due: Due
) -> Generator[None, None, MapEdit]:
    """How ``devices`` differs from ``base``, as the edit :meth:`DeviceTree.with_changes`
    would have given: ids gone or new, and ids whose DeviceInfo is another object (both)."""
    removed = set(base.keys() - devices.keys())
    added = set(devices.keys() - base.keys())
    for count, (device_id, info) in enumerate(devices.items()):
        before = base.get(device_id)
        if before is not None and before is not info:
            removed.add(device_id)
            added.add(device_id)
        if count % SORT_RUN == 0 and due():
            yield
    return MapEdit(base, frozenset(removed), frozenset(added))


def _natural_order(ids: Iterable[str], due: Due) -> Generator[None, None, list[str]]:
    """``sorted(ids, key=natural_key)`` in slices: the keys made and runs of SORT_RUN sorted a
    slice at a time, then merged (sorting 10,000 ids at once blocks for ~40 ms). Keys end with
    the id itself, so no two ids tie and the order is the one sorted() gives."""
    keyed: list[tuple[NaturalKey, str]] = []
    for device_id in ids:
        keyed.append((natural_key(device_id), device_id))
        if due():
            yield
    runs: list[list[tuple[NaturalKey, str]]] = []
    for start in range(0, len(keyed), SORT_RUN):
        runs.append(sorted(keyed[start : start + SORT_RUN]))
        if due():
            yield
    order: list[str] = []
    for _, device_id in heapq.merge(*runs):
        order.append(device_id)
        if due():
            yield
    return order

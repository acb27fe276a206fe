"""CDI names in Allocate answers: only for devices the spec on disk defines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from devplug.cdi.catalog import CdiCatalog
from devplug.cdi.names import annotation_key, qualified_name
from devplug.model import ContainerAllocation, DeviceInfo

# The plugin part of devplug's cdi.k8s.io/<plugin>_<resource> annotation keys.
ANNOTATION_PLUGIN = "devplug"


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
        env=answer.env,  # never in the spec: see devplug.cdi.build.device_edits
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

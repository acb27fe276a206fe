"""The kubelet stand-in's pod resources API (v1): what its own Allocate calls handed out.

Written from the kubelet's ``pkg/kubelet/apis/podresources/server_v1.go`` and device manager:

- ``List``: every pod, in the order it was first given a device, each with all of its
  containers; a container's devices as one ``ContainerDevices`` entry per device and NUMA
  node (the NUMA nodes the device had when it was allocated), one without topology for a
  device that had none. A device that has since turned unhealthy or gone stays listed: the
  kubelet keeps an allocation until the pod ends (:meth:`PodBook.release` here).
- ``GetAllocatableResources``: the healthy devices of every resource whose plugin is
  connected, from its latest list, in the same shape. A test can pin a resource's set
  (:meth:`~devplug.testing.KubeletSimulator.pin_allocatable`) to play a kubelet whose view
  went stale. With ``PodResourcesGates(get_allocatable=False)`` it answers as a kubelet with
  ``KubeletPodResourcesGetAllocatable`` off (before 1.28): UNKNOWN, "Pod Resources API
  GetAllocatableResources disabled".
- ``Get``: one pod; UNKNOWN "pod NAME in namespace NS not found" for a pod it does not know,
  and "PodResources API Get method disabled" with ``PodResourcesGates(get=False)`` (the
  ``KubeletPodResourcesGet`` gate, off by default before 1.34).

Errors are plain errors in the kubelet, so their gRPC code is UNKNOWN; the texts are its.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from devplug._proto import podresources_v1_pb2 as pr
from devplug._proto import podresources_v1_pb2_grpc as pr_grpc
from devplug.kubelet.podresources import Holder
from devplug.model import ContainerAllocation
from devplug.naming import DNS1123_LABEL, DNS1123_SUBDOMAIN, MAX_LABEL, MAX_SUBDOMAIN

DEFAULT_NAMESPACE = "default"
DEFAULT_CONTAINER = "main"

# device id -> its NUMA nodes (none: a device without topology)
Devices = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class PodResourcesGates:
    """The kubelet feature gates that change what the pod resources API answers."""

    get_allocatable: bool = True  # KubeletPodResourcesGetAllocatable (GA, gate gone in 1.30)
    get: bool = True  # KubeletPodResourcesGet (beta, on by default from 1.34)


def name_problem(what: str, name: str) -> str | None:
    """Why ``name`` cannot be a namespace, pod or container name (None: it can)."""
    pattern, limit, kind = (
        (DNS1123_SUBDOMAIN, MAX_SUBDOMAIN, "a DNS-1123 subdomain")
        if what == "pod"
        else (DNS1123_LABEL, MAX_LABEL, "a DNS-1123 label")
    )
    if len(name) > limit or not pattern.match(name):
        return (
            f"{what} name {name!r} must be {kind}: lower-case letters, digits and '-', "
            f"starting and ending with a letter or digit, at most {limit} characters"
        )
    return None


def parse_pod(text: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` (or ``NAME``, in ``default``) -> (namespace, name); ValueError
    naming the part that is wrong."""
    namespace, slash, name = text.rpartition("/")
    if not slash:
        namespace = DEFAULT_NAMESPACE
    for what, value in (("namespace", namespace), ("pod", name)):
        problem = name_problem(what, value)
        if problem is not None:
            raise ValueError(f"{problem} (give the pod as NAMESPACE/NAME)")
    return namespace, name


class PodBook:
    """What the stand-in kubelet handed out: pod -> container -> resource -> devices, pods in
    the order they first got a device. Kept across :meth:`KubeletSimulator.restart`, as the
    kubelet keeps its checkpoint."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, dict[str, dict[str, tuple[int, ...]]]]] = {}
        # (resource, id) -> who asked for it, while its Allocate call is out
        self._pending: dict[tuple[str, str], Holder] = {}

    def new_pod_name(self) -> str:
        """The first ``pod-<n>`` of the default namespace that holds nothing, for an
        allocation that names no pod."""
        taken = {*self.pods, *((h.namespace, h.pod) for h in self._pending.values())}
        number = 1
        while (DEFAULT_NAMESPACE, f"pod-{number}") in taken:
            number += 1
        return f"pod-{number}"

    def holders(self, resource: str, device: str) -> list[Holder]:
        return [
            Holder(namespace, pod, container)
            for (namespace, pod), containers in self.pods.items()
            for container, resources in containers.items()
            if device in resources.get(resource, {})
        ]

    def reserve(self, holder: Holder, resource: str, ids: Sequence[str]) -> None:
        """Claim ``ids`` for ``holder`` while its Allocate call is out; ValueError for an id
        another container holds: the kubelet never hands out a device twice."""
        for device in ids:
            others = [h for h in self.holders(resource, device) if h != holder]
            pending = self._pending.get((resource, device))
            if pending is not None and pending != holder:
                others.append(pending)
            if others:
                raise ValueError(
                    f"{resource} device {device} is in use by {others[0]}: the kubelet hands "
                    "a device to one container at a time (release its pod first)"
                )
        for device in ids:
            self._pending[(resource, device)] = holder

    def unreserve(self, resource: str, ids: Sequence[str]) -> None:
        for device in ids:
            self._pending.pop((resource, device), None)

    def record(self, holder: Holder, resource: str, devices: Devices) -> None:
        containers = self.pods.setdefault((holder.namespace, holder.pod), {})
        held = containers.setdefault(holder.container, {}).setdefault(resource, {})
        held.update(devices)

    def release(self, namespace: str, pod: str) -> dict[str, list[str]]:
        """The pod ended: its devices are free again. Returns them by resource; LookupError
        for a pod that holds nothing."""
        containers = self.pods.pop((namespace, pod), None)
        if containers is None:
            known = ", ".join(f"{ns}/{name}" for ns, name in self.pods) or "none"
            raise LookupError(f"no pod {namespace}/{pod} holds devices (pods: {known})")
        freed: dict[str, list[str]] = {}
        for resources in containers.values():
            for resource, devices in resources.items():
                freed.setdefault(resource, []).extend(devices)
        return freed


def device_entries(resource: str, devices: Devices) -> Iterator[pr.ContainerDevices]:
    """The kubelet's shape: one entry per device and NUMA node, or one without topology."""
    for device, numa_nodes in devices.items():
        if not numa_nodes:
            yield pr.ContainerDevices(resource_name=resource, device_ids=[device])
            continue
        for node in numa_nodes:
            yield pr.ContainerDevices(
                resource_name=resource,
                device_ids=[device],
                topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)]),
            )


class PodResourcesLister(pr_grpc.PodResourcesListerServicer):
    """The service, over a :class:`PodBook` and the allocatable devices the simulator sees
    (``allocatable()``: resource -> devices)."""

    def __init__(
        self,
        book: PodBook,
        allocatable: Callable[[], Mapping[str, Devices]],
        gates: PodResourcesGates,
    ) -> None:
        self.book = book
        self.allocatable = allocatable
        self.gates = gates
        self.calls: dict[str, int] = {"List": 0, "GetAllocatableResources": 0, "Get": 0}

    def _pod(self, namespace: str, name: str) -> pr.PodResources:
        containers = self.book.pods[(namespace, name)]
        return pr.PodResources(
            name=name,
            namespace=namespace,
            containers=[
                pr.ContainerResources(
                    name=container,
                    devices=[
                        entry
                        for resource, devices in resources.items()
                        for entry in device_entries(resource, devices)
                    ],
                )
                for container, resources in containers.items()
            ],
        )

    async def List(
        self,
        request: pr.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[pr.ListPodResourcesRequest, pr.ListPodResourcesResponse],
    ) -> pr.ListPodResourcesResponse:
        self.calls["List"] += 1
        return pr.ListPodResourcesResponse(
            pod_resources=[self._pod(namespace, name) for namespace, name in self.book.pods]
        )

    async def GetAllocatableResources(
        self,
        request: pr.AllocatableResourcesRequest,
        context: grpc.aio.ServicerContext[
            pr.AllocatableResourcesRequest, pr.AllocatableResourcesResponse
        ],
    ) -> pr.AllocatableResourcesResponse:
        self.calls["GetAllocatableResources"] += 1
        if not self.gates.get_allocatable:
            await context.abort(
                grpc.StatusCode.UNKNOWN, "Pod Resources API GetAllocatableResources disabled"
            )
        return pr.AllocatableResourcesResponse(
            devices=[
                entry
                for resource, devices in self.allocatable().items()
                for entry in device_entries(resource, devices)
            ]
        )

    async def Get(
        self,
        request: pr.GetPodResourcesRequest,
        context: grpc.aio.ServicerContext[pr.GetPodResourcesRequest, pr.GetPodResourcesResponse],
    ) -> pr.GetPodResourcesResponse:
        self.calls["Get"] += 1
        if not self.gates.get:
            await context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        key = (request.pod_namespace, request.pod_name)
        if key not in self.book.pods:
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return pr.GetPodResourcesResponse(pod_resources=self._pod(*key))


class _Listed(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def health(self) -> str: ...

    @property
    def numa_nodes(self) -> tuple[int, ...]: ...


class PluginConnection(Protocol):
    """What the stand-in needs of a registered plugin (the simulator's PluginSession)."""

    stream_ended: asyncio.Event

    @property
    def latest(self) -> Mapping[str, _Listed]: ...

    async def allocate(self, *containers: Sequence[str]) -> list[ContainerAllocation]: ...


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """An Allocate the stand-in made for a pod's container, and the plugin's answer."""

    holder: Holder
    resource: str
    ids: tuple[str, ...]
    answer: ContainerAllocation


class PodResourcesStandIn:
    """The API on ``socket``, over the allocations made through :meth:`allocate` and the lists
    of the plugins ``plugins()`` names (resource -> its connection)."""

    def __init__(
        self,
        socket: Path,
        plugins: Callable[[], Mapping[str, PluginConnection]],
        gates: PodResourcesGates,
    ) -> None:
        self.socket = socket
        self.plugins = plugins
        self.book = PodBook()
        # resource -> the allocatable devices a test pinned (a kubelet whose view went stale)
        self.pinned: dict[str, Devices] = {}
        self.lister = PodResourcesLister(self.book, self.allocatable, gates)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self.lister, server)
        server.add_insecure_port(f"unix://{self.socket.absolute()}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop serving (the socket file is removed); the allocations stay."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)

    async def allocate(
        self,
        resource: str,
        ids: Sequence[str],
        pod: str | None = None,
        container: str = DEFAULT_CONTAINER,
    ) -> PodAllocation:
        """See :meth:`devplug.testing.KubeletSimulator.allocate`."""
        plugin = self.plugins().get(resource)
        if plugin is None:
            known = ", ".join(sorted(self.plugins())) or "none yet"
            raise LookupError(f"{resource} is not registered (registered: {known})")
        if pod is None:
            namespace, name = DEFAULT_NAMESPACE, self.book.new_pod_name()
        else:
            namespace, name = parse_pod(pod)
        problem = name_problem("container", container)
        if problem is not None:
            raise ValueError(problem)
        holder = Holder(namespace, name, container)
        wanted = tuple(ids)
        self.book.reserve(holder, resource, wanted)
        try:
            (answer,) = await plugin.allocate(wanted)
            self.book.record(holder, resource, _numa_of(plugin.latest, wanted))
        finally:
            self.book.unreserve(resource, wanted)
        return PodAllocation(holder, resource, wanted, answer)

    def release(self, pod: str) -> dict[str, list[str]]:
        """See :meth:`devplug.testing.KubeletSimulator.release`."""
        return self.book.release(*parse_pod(pod))

    def pin(self, resource: str, ids: Sequence[str] | None) -> None:
        """See :meth:`devplug.testing.KubeletSimulator.pin_allocatable`."""
        if ids is None:
            self.pinned.pop(resource, None)
            return
        plugin = self.plugins().get(resource)
        self.pinned[resource] = _numa_of({} if plugin is None else plugin.latest, ids)

    def allocatable(self) -> dict[str, Devices]:
        """What GetAllocatableResources answers: the healthy devices of each plugin that is
        connected (one whose stream ended has none, as the kubelet marks its devices
        unhealthy), or the pinned ones."""
        found: dict[str, Devices] = {}
        for resource, plugin in self.plugins().items():
            if not plugin.stream_ended.is_set():
                listed = plugin.latest.values()
                found[resource] = {d.id: d.numa_nodes for d in listed if d.health == "Healthy"}
        found.update(self.pinned)
        return found


def _numa_of(listed: Mapping[str, _Listed], ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Each id's NUMA nodes in the plugin's latest list (none for an id it does not list)."""
    return {i: listed[i].numa_nodes if i in listed else () for i in ids}

"""Reading the kubelet's pod resources API (v1): which pod's container holds which device.

The kubelet serves ``PodResourcesLister`` on ``<kubelet root>/pod-resources/kubelet.sock``,
read-only, to anything that can open the socket: no API server credentials are involved.
:func:`read_pod_resources` asks it ``List`` (every pod, every container, its devices) and
``GetAllocatableResources`` (the healthy devices of every registered resource) and hands
back plain values: nothing outside this module sees protobuf.

What the kubelet sends, and how it is read:

- Devices come as ``ContainerDevices`` entries: a resource name, device ids and a NUMA
  topology, one entry per device and NUMA node (a device on two nodes comes twice; one
  without topology once, without it). Holders and allocatable ids are therefore sets.
- ``GetAllocatableResources`` sits behind the ``KubeletPodResourcesGetAllocatable`` gate
  before Kubernetes 1.28 (on by default from 1.23): a kubelet with it off answers UNKNOWN
  ("... GetAllocatableResources disabled"), one older than 1.21 UNIMPLEMENTED. Either way the
  holders are still known; only the allocatable set is not (:attr:`PodResourcesView.allocatable`
  None, with the reason).
- The kubelet's own clients read up to 16 MiB and give up after 10 s; so does this one.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from devplug._proto import podresources_v1_pb2 as pr

# <kubelet root>/pod-resources/kubelet.sock: the kubelet root is the device plugin dir's
# parent (/var/lib/kubelet/device-plugins -> /var/lib/kubelet).
POD_RESOURCES_DIR = "pod-resources"
POD_RESOURCES_SOCKET = "kubelet.sock"
READ_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

ABSENT = "absent"
NOT_ANSWERING = "not answering"
# The reason of a path that is there but no socket (a file, a dir): not the kubelet's doing.
NOT_A_SOCKET = "not a socket"

# Which resources a reading keeps: names, or a test of a name (asked in a worker thread).
Wanted = Collection[str] | Callable[[str], bool]


def default_socket(kubelet_dir: Path) -> Path:
    """Where the kubelet serves the pod resources API, for its device plugin dir."""
    return kubelet_dir.parent / POD_RESOURCES_DIR / POD_RESOURCES_SOCKET


@dataclass(frozen=True, slots=True, order=True)
class Holder:
    """A container the kubelet gave a device to."""

    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


# resource -> device id -> the containers holding it (sorted; one in the usual case)
Holdings = Mapping[str, Mapping[str, tuple[Holder, ...]]]


@dataclass(frozen=True, slots=True)
class PodResourcesView:
    """One reading of the pod resources API."""

    held: Holdings
    # resource -> the ids the kubelet could allocate (its healthy devices); None: the kubelet
    # does not answer GetAllocatableResources (``allocatable_error`` says why).
    allocatable: Mapping[str, frozenset[str]] | None
    allocatable_error: str | None = None
    pods: int = 0  # pods listed, devices or not
    containers: int = 0

    def holders(self, resource: str, device: str) -> tuple[Holder, ...]:
        return self.held.get(resource, {}).get(device, ())


class PodResourcesUnavailable(Exception):
    """The API could not be read: the socket is ``absent`` (a kubelet without the API, or a
    pod without the mount) or ``not answering`` (the reason says how)."""

    def __init__(self, socket: Path, state: str, reason: str) -> None:
        super().__init__(f"{socket}: {reason}")
        self.socket = socket
        self.state = state
        self.reason = reason


def check_socket(socket: Path) -> PodResourcesUnavailable | None:
    """Why ``socket`` cannot be dialled (None: it is a socket file)."""
    try:
        mode = os.lstat(socket).st_mode
    except FileNotFoundError:
        where = socket.parent
        reason = f"no {socket.name} in {where}" if where.is_dir() else f"no {where}"
        return PodResourcesUnavailable(socket, ABSENT, reason)
    except OSError as exc:
        return PodResourcesUnavailable(socket, NOT_ANSWERING, exc.strerror or str(exc))
    if not stat.S_ISSOCK(mode):
        return PodResourcesUnavailable(socket, NOT_ANSWERING, NOT_A_SOCKET)
    return None


async def read_pod_resources(
    socket: Path,
    *,
    resources: Wanted | None = None,
    timeout: float = READ_TIMEOUT_S,
) -> PodResourcesView:
    """List the pods' devices and the allocatable ones, of ``resources`` (names, or a test of
    a name; None: every resource). Raises :class:`PodResourcesUnavailable`.

    The answers are taken as bytes and decoded in a worker thread: at 10,000 devices that is
    tens of milliseconds of Python, which on the event loop would hold up every RPC.
    """
    problem = check_socket(socket)
    if problem is not None:
        raise problem
    # Loaded here, at the first read: a daemon's start-up does not wait for it.
    import grpc

    # gRPC's unix: target wants an absolute path ("unix://rel/x" names an authority).
    channel = grpc.aio.insecure_channel(
        f"unix://{socket.absolute()}",
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    try:
        # Both requests are empty messages: zero bytes on the wire.
        listed, allocatable = await asyncio.gather(
            _raw(channel, "List")(b"", timeout=timeout),
            _allocatable(channel, timeout),
        )
    except grpc.aio.AioRpcError as exc:
        reason = f"{exc.code().name}: {exc.details()}"
        raise PodResourcesUnavailable(socket, NOT_ANSWERING, reason) from None
    finally:
        await channel.close(None)
    if resources is None or callable(resources):
        return await asyncio.to_thread(_decode, listed, allocatable, resources)
    return await asyncio.to_thread(_decode, listed, allocatable, frozenset(resources).__contains__)


def _raw(channel: grpc.aio.Channel, name: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    """One of the service's methods (``/v1.PodResourcesLister/List``), bytes in and out."""
    from devplug._proto import podresources_v1_pb2 as pr

    service = pr.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name
    return channel.unary_unary(f"/{service}/{name}", None, None)


async def _allocatable(channel: grpc.aio.Channel, timeout: float) -> bytes | str:
    """The answer's bytes, or why this kubelet does not give it (a gate off, a kubelet too
    old)."""
    import grpc

    try:
        answer: bytes = await _raw(channel, "GetAllocatableResources")(b"", timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        # The kubelet answers a disabled method with a plain error (UNKNOWN); one that has
        # no such method, UNIMPLEMENTED. Anything else is the socket's trouble, not the API's.
        if exc.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED):
            return f"{exc.code().name}: {exc.details()}"
        raise
    return answer


def _decode(
    listed: bytes, allocatable: bytes | str, wanted: Callable[[str], bool] | None
) -> PodResourcesView:
    """The two answers as plain values (in a worker thread)."""
    from devplug._proto import podresources_v1_pb2 as pr

    held, pods, containers = _holdings(pr.ListPodResourcesResponse.FromString(listed), wanted)
    if isinstance(allocatable, str):
        return PodResourcesView(held, None, allocatable, pods, containers)
    answer = pr.AllocatableResourcesResponse.FromString(allocatable)
    return PodResourcesView(held, _allocatable_ids(answer, wanted), None, pods, containers)


def _holdings(
    listed: pr.ListPodResourcesResponse, wanted: Callable[[str], bool] | None
) -> tuple[Holdings, int, int]:
    found: dict[str, dict[str, set[Holder]]] = {}
    containers = 0
    for pod in listed.pod_resources:
        for container in pod.containers:
            containers += 1
            holder: Holder | None = None
            for entry in container.devices:
                if wanted is not None and not wanted(entry.resource_name):
                    continue
                if holder is None:
                    holder = Holder(pod.namespace, pod.name, container.name)
                devices = found.setdefault(entry.resource_name, {})
                for device in entry.device_ids:
                    devices.setdefault(device, set()).add(holder)
    held = MappingProxyType(
        {
            resource: MappingProxyType({d: tuple(sorted(h)) for d, h in devices.items()})
            for resource, devices in found.items()
        }
    )
    return held, len(listed.pod_resources), containers


def _allocatable_ids(
    answer: pr.AllocatableResourcesResponse, wanted: Callable[[str], bool] | None
) -> Mapping[str, frozenset[str]]:
    found: dict[str, set[str]] = {}
    for entry in answer.devices:
        if wanted is None or wanted(entry.resource_name):
            found.setdefault(entry.resource_name, set()).update(entry.device_ids)
    return MappingProxyType({resource: frozenset(ids) for resource, ids in found.items()})

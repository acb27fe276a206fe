"""A kubelet stand-in for tests: the Registration service plus a device manager's client side.

It behaves like the kubelet where a plugin can tell the difference (and is stricter where that
catches plugin bugs early: it refuses an endpoint that is not a socket file in its dir at once,
where the kubelet would time out dialling it; error texts are its own, the status code, UNKNOWN,
is the kubelet's): it serves Registration on
``kubelet.sock`` in the directory you give it; it refuses a wrong API version, a resource name
the kubelet would refuse and an endpoint that is not a socket file in its dir; before answering
Register it dials the plugin back and calls GetDevicePluginOptions (so a plugin that blocks its
event loop while registering deadlocks here as it would on a node); then it opens ListAndWatch
and records every list. :meth:`KubeletSimulator.restart` does what a kubelet restart does to
the dir: its socket goes, every socket file but the checkpoint is deleted, ``kubelet.sock``
comes back.

It also serves the kubelet's pod resources API beside the dir
(``<dir>/../pod-resources/kubelet.sock``, see :mod:`devplug.testing.podresources`), fed by
:meth:`KubeletSimulator.allocate`: each allocation belongs to a pod's container, and is
listed until :meth:`KubeletSimulator.release` ends the pod.

Plugin authors: see docs/writing-a-scanner.md, which tests a scanner with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.kubelet.podresources import default_socket
from devplug.kubelet.registration import API_VERSION, CHECKPOINT_FILE, KUBELET_SOCKET
from devplug.kubelet.wire import container_allocation
from devplug.model import ContainerAllocation
from devplug.naming import resource_name_problem
from devplug.testing.daemon_log import daemon_note
from devplug.testing.podresources import (
    DEFAULT_CONTAINER,
    PodAllocation,
    PodBook,
    PodResourcesGates,
    PodResourcesStandIn,
)
from devplug.testing.waiting import describe_callable, waiting_for

T = TypeVar("T")

# The kubelet dials a registering plugin with a 10 s timeout.
DIAL_TIMEOUT_S = 10.0
DEFAULT_WAIT_S = 10.0
OPTIONS_TIMEOUT_S = 30.0
# How much of what it saw a timed-out wait quotes.
SHOWN_IDS = 10
SHOWN_REGISTRATIONS = 3


class _Refused(Exception):
    """Register is answered with this message as an error."""


class SimulatorRpcError(Exception):
    """A plugin answered an RPC with an error status. ``code`` is the status name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True, slots=True)
class ListedDevice:
    """One device of a ListAndWatch message, as the kubelet records it."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PluginOptions:
    pre_start_required: bool
    get_preferred_allocation_available: bool


@dataclass(frozen=True, slots=True)
class Registration:
    """One Register call and the simulator's verdict."""

    resource: str
    endpoint: str
    version: str
    accepted: bool
    error: str | None
    generation: int
    at: float = field(default_factory=time.perf_counter)  # when the verdict was made


async def _call(call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except grpc.aio.AioRpcError as exc:
        raise SimulatorRpcError(exc.code().name, exc.details() or "") from None


class PluginSession:
    """One registered plugin as the kubelet sees it: a channel, options and the lists it sent."""

    def __init__(
        self, resource: str, endpoint: Path, options: PluginOptions, generation: int
    ) -> None:
        self.resource = resource
        self.endpoint = endpoint
        self.options = options
        self.generation = generation
        self.updates: list[dict[str, ListedDevice]] = []
        self.update_times: list[float] = []
        self.stream_error: str | None = None
        self.stream_ended = asyncio.Event()
        self._changed = asyncio.Condition()
        self.channel = grpc.aio.insecure_channel(f"unix://{endpoint}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self._task: asyncio.Task[None] | None = None

    @property
    def latest(self) -> dict[str, ListedDevice]:
        """The last list received ({} before the first)."""
        return self.updates[-1] if self.updates else {}

    def healthy_ids(self) -> set[str]:
        return {d.id for d in self.latest.values() if d.health == "Healthy"}

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"sim-listandwatch:{self.resource}")

    async def _watch(self) -> None:
        try:
            async for message in self.stub.ListAndWatch(pb.Empty()):
                # When the message arrived (decoded, as the kubelet's client decodes it), not
                # when this simulator has converted it: that takes tens of milliseconds at
                # 10,000 devices, which are the simulator's own, not the plugin's.
                received = time.perf_counter()
                listed = {
                    d.ID: ListedDevice(d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
                    for d in message.devices
                }
                async with self._changed:
                    self.updates.append(listed)
                    self.update_times.append(received)
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as exc:
            self.stream_error = f"{exc.code().name}: {exc.details()}"
        finally:
            self.stream_ended.set()
            async with self._changed:
                self._changed.notify_all()

    async def wait_for_update(
        self,
        predicate: Callable[[dict[str, ListedDevice]], bool] | None = None,
        *,
        after: int = 0,
        timeout: float | None = DEFAULT_WAIT_S,
    ) -> dict[str, ListedDevice]:
        """Wait for a list (the ``after``-th or later) that satisfies ``predicate``; return it
        (``timeout`` None: as long as it takes). A stream that ends first raises
        AssertionError."""

        def found() -> dict[str, ListedDevice] | None:
            for listed in self.updates[after:]:
                if predicate is None or predicate(listed):
                    return listed
            return None

        wanted = f"a ListAndWatch list of {self.resource}"
        if after:
            wanted += f" (list {after + 1} or later)"
        if predicate is not None:
            wanted += f" matching {describe_callable(predicate)}"
        async with waiting_for(timeout, wanted, self._lists_seen), self._changed:
            while (hit := found()) is None:
                if self.stream_ended.is_set():
                    raise AssertionError(
                        f"{self.resource}: ListAndWatch ended ({self.stream_error or 'OK'}) "
                        f"before {wanted}; {self._lists_seen()}{daemon_note()}"
                    )
                await self._changed.wait()
            return hit

    def _lists_seen(self) -> str:
        if not self.updates:
            return "got no list"
        ids = list(self.latest)
        shown = ", ".join(ids[:SHOWN_IDS]) + (", ..." if len(ids) > SHOWN_IDS else "") or "none"
        return f"got {len(self.updates)} lists, the last with {len(ids)} devices ({shown})"

    async def get_options(self) -> PluginOptions:
        got = await _call(lambda: self.stub.GetDevicePluginOptions(pb.Empty()))
        return PluginOptions(got.pre_start_required, got.get_preferred_allocation_available)

    async def allocate(self, *containers: Sequence[str]) -> list[ContainerAllocation]:
        """Allocate, one id list per container; errors raise SimulatorRpcError."""
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
        )
        answer = await _call(lambda: self.stub.Allocate(request))
        return [container_allocation(c) for c in answer.container_responses]

    async def preferred(
        self, available: Sequence[str], size: int, must_include: Sequence[str] = ()
    ) -> list[str]:
        """GetPreferredAllocation for one container; refused if the plugin did not offer it."""
        if not self.options.get_preferred_allocation_available:
            raise AssertionError(
                f"{self.resource}: the kubelet would not call GetPreferredAllocation: the plugin "
                "registered without get_preferred_allocation_available"
            )
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        answer = await _call(lambda: self.stub.GetPreferredAllocation(request))
        return list(answer.container_responses[0].deviceIDs)

    async def pre_start(self, device_ids: Sequence[str]) -> None:
        if not self.options.pre_start_required:
            raise AssertionError(
                f"{self.resource}: the kubelet would not call PreStartContainer: the plugin "
                "registered without pre_start_required"
            )
        request = pb.PreStartContainerRequest(devices_ids=device_ids)
        await _call(lambda: self.stub.PreStartContainer(request))

    async def close(self) -> None:
        """Drop the connection, as the kubelet does when it goes away."""
        if self._task is not None and not self._task.done():
            if self.stream_error is None:
                self.stream_error = "closed by the kubelet simulator"
            self._task.cancel()
            await asyncio.wait({self._task})  # never swallows a cancellation of our caller
        await self.channel.close(None)


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, simulator: KubeletSimulator) -> None:
        self.simulator = simulator

    async def Register(
        self,
        request: pb.RegisterRequest,
        context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty],
    ) -> pb.Empty:
        error = await self.simulator._admit(request)
        if error is not None:
            # The kubelet answers a refused registration with a plain error (code UNKNOWN).
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return pb.Empty()


class KubeletSimulator:
    """Serve Registration in ``directory``; use ``async with KubeletSimulator(dir) as kubelet``.

    The pod resources API is served on ``pod_resources_socket`` (default: beside the dir, where
    the kubelet serves it); ``pod_resources=False`` plays a kubelet without it (or a pod
    without its mount); ``gates`` plays a kubelet with some of its methods off.
    """

    def __init__(
        self,
        directory: Path,
        *,
        dial_timeout: float = DIAL_TIMEOUT_S,
        pod_resources: bool = True,
        pod_resources_socket: Path | None = None,
        gates: PodResourcesGates = PodResourcesGates(),  # noqa: B008 - frozen, shared safely
    ) -> None:
        self.directory = Path(directory)
        self.dial_timeout = dial_timeout
        self.socket_path = self.directory / KUBELET_SOCKET
        self.checkpoint_path = self.directory / CHECKPOINT_FILE
        self.pod_resources = PodResourcesStandIn(
            pod_resources_socket or default_socket(self.directory), lambda: self.sessions, gates
        )
        self._serve_pod_resources = pod_resources
        self.registrations: list[Registration] = []
        self.sessions: dict[str, PluginSession] = {}
        self.generation = 0
        self.serving_since = 0.0
        self._retired: list[PluginSession] = []
        self._server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()

    async def __aenter__(self) -> KubeletSimulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Create the dir and checkpoint if missing, then serve Registration on kubelet.sock."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.checkpoint_path.exists():
            self.checkpoint_path.write_text('{"Data":{"PodDeviceEntries":null},"Checksum":0}')
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        # When kubelet.sock came (back): the start of a restart's re-registration clock.
        self.serving_since = time.perf_counter()
        if self._serve_pod_resources:
            await self.pod_resources.start()

    async def stop(self) -> None:
        """Stop serving and drop every plugin connection (kubelet.sock is removed, and the
        pod resources socket)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
        await self.pod_resources.stop()
        sessions = [*self.sessions.values(), *self._retired]
        self.sessions = {}
        self._retired = []
        await asyncio.gather(*(s.close() for s in sessions))

    async def restart(self) -> None:
        """What a kubelet restart does: stop, delete plugin sockets (not the checkpoint), serve."""
        await self.stop()
        for entry in os.scandir(self.directory):
            if entry.name == CHECKPOINT_FILE:
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
        self.generation += 1
        await self.start()

    # ------------------------------------------------------------------ pods and their devices

    @property
    def pod_resources_socket(self) -> Path | None:
        """Where the pod resources API is served (None: it is not)."""
        return self.pod_resources.socket if self._serve_pod_resources else None

    @property
    def pods(self) -> PodBook:
        """The allocations the pod resources API lists."""
        return self.pod_resources.book

    async def allocate(
        self,
        resource: str,
        ids: Sequence[str],
        *,
        pod: str | None = None,
        container: str = DEFAULT_CONTAINER,
    ) -> PodAllocation:
        """Allocate ``ids`` of ``resource`` for one container of ``pod`` (``NAMESPACE/NAME``;
        default a new ``default/pod-<n>``), as the kubelet admits a pod: ids another container
        holds are refused here (ValueError), as the kubelet never picks them; the rest go to
        the plugin (its refusal raises SimulatorRpcError). Once the plugin has answered, the
        pod resources API lists the allocation, with the NUMA nodes the plugin listed."""
        return await self.pod_resources.allocate(resource, ids, pod, container)

    def release(self, pod: str) -> dict[str, list[str]]:
        """The pod (``NAMESPACE/NAME``) ended: its devices leave the pod resources API. Returns
        them by resource; LookupError for a pod that holds nothing."""
        return self.pod_resources.release(pod)

    def pin_allocatable(self, resource: str, ids: Sequence[str] | None) -> None:
        """Make GetAllocatableResources answer ``ids`` for ``resource`` whatever its plugin
        lists, as a kubelet whose view went stale would (None: follow the lists again)."""
        self.pod_resources.pin(resource, ids)

    async def _admit(self, request: pb.RegisterRequest) -> str | None:
        error = self._check(request)
        session: PluginSession | None = None
        if error is None:
            try:
                session = await self._connect(request)
            except _Refused as exc:
                error = str(exc)
        async with self._changed:
            self.registrations.append(
                Registration(
                    request.resource_name,
                    request.endpoint,
                    request.version,
                    error is None,
                    error,
                    self.generation,
                )
            )
            if session is not None:
                old = self.sessions.get(request.resource_name)
                if old is not None:
                    # A re-registration replaces the previous connection. Older kubelets closed
                    # it; current ones leave the old stream running until it ends and then mark
                    # the resource unhealthy, so a plugin must not keep an old stream open.
                    self._retired.append(old)
                    await old.close()
                self.sessions[request.resource_name] = session
                session.start()
            self._changed.notify_all()
        return error

    def _check(self, request: pb.RegisterRequest) -> str | None:
        if request.version != API_VERSION:
            return (
                f"Requested device plugin version {request.version!r} is not supported; "
                f"supported: [{API_VERSION}]"
            )
        problem = resource_name_problem(request.resource_name)
        if problem is not None:
            return f"invalid name of device plugin socket: {request.resource_name!r}: {problem}"
        endpoint = request.endpoint
        if not endpoint or "/" in endpoint or endpoint in (".", ".."):
            return f"endpoint must be a file name in {self.directory}, got {endpoint!r}"
        try:
            mode = os.lstat(self.directory / endpoint).st_mode
        except OSError:
            return f"endpoint {endpoint!r} does not exist in {self.directory}"
        if not stat.S_ISSOCK(mode):
            return f"endpoint {endpoint!r} is not a unix socket"
        return None

    async def _connect(self, request: pb.RegisterRequest) -> PluginSession:
        """Dial back and ask for the options, as the kubelet does before answering Register."""
        endpoint = self.directory / request.endpoint
        probe = PluginSession(
            request.resource_name, endpoint, PluginOptions(False, False), self.generation
        )
        try:
            try:
                await asyncio.wait_for(probe.channel.channel_ready(), self.dial_timeout)
            except TimeoutError:
                raise _Refused(
                    f"failed to dial device plugin {request.endpoint}: context deadline exceeded"
                ) from None
            try:
                # The kubelet sets no deadline here; a generous one keeps a broken test finite.
                got = await probe.stub.GetDevicePluginOptions(pb.Empty(), timeout=OPTIONS_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise _Refused(f"failed to get device plugin options: {exc.details()}") from None
        except BaseException:
            await probe.close()
            raise
        probe.options = PluginOptions(
            got.pre_start_required, got.get_preferred_allocation_available
        )
        return probe

    async def wait_for_plugin(
        self,
        resource: str,
        *,
        generation: int | None = None,
        replacing: PluginSession | None = None,
        timeout: float = DEFAULT_WAIT_S,
    ) -> PluginSession:
        """Wait until ``resource`` is registered in ``generation`` (default: the current one).

        With ``replacing``, wait for a registration newer than that session.
        """
        wanted = self.generation if generation is None else generation

        def ready() -> PluginSession | None:
            session = self.sessions.get(resource)
            if session is not None and session.generation >= wanted and session is not replacing:
                return session
            return None

        what = f"{resource} to register with the kubelet simulator in {self.directory}"
        what += f" (kubelet generation {wanted}{', a new session' if replacing else ''})"
        seen = functools.partial(self._registrations_of, resource)
        async with waiting_for(timeout, what, seen), self._changed:
            while (session := ready()) is None:
                await self._changed.wait()
            return session

    def _registrations_of(self, resource: str) -> str:
        """What the simulator saw of ``resource``'s registrations, for a failed wait."""
        mine = [r for r in self.registrations if r.resource == resource]
        if not mine:
            known = sorted({r.resource for r in self.registrations})
            return f"no Register call named it (Register calls: {', '.join(known) or 'none'})"
        verdicts = [
            f"generation {r.generation}: " + ("accepted" if r.accepted else f"refused: {r.error}")
            for r in mine[-SHOWN_REGISTRATIONS:]
        ]
        return f"{len(mine)} Register calls named it, the last: " + "; ".join(verdicts)

    async def wait_for_registrations(
        self, count: int, *, timeout: float | None = DEFAULT_WAIT_S
    ) -> list[Registration]:
        """Wait until at least ``count`` Register calls have been answered (``timeout`` None:
        as long as it takes)."""

        def seen() -> str:
            verdicts = [
                f"{r.resource} {'accepted' if r.accepted else 'refused'}"
                for r in self.registrations[-SHOWN_REGISTRATIONS:]
            ]
            return f"got {len(self.registrations)}" + (
                f", the last: {'; '.join(verdicts)}" if verdicts else ""
            )

        what = f"{count} Register calls to the kubelet simulator in {self.directory}"
        async with waiting_for(timeout, what, seen), self._changed:
            while len(self.registrations) < count:
                await self._changed.wait()
            return list(self.registrations)

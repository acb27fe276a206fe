"""The kubelet simulator itself, driven over real unix sockets by raw gRPC clients and servers.

Every plugin here is a hand-written ``DevicePluginServicer`` served by ``grpc.aio`` on a socket
in the device plugin dir, and every Register is a raw ``RegistrationStub`` call on
``kubelet.sock``: nothing of the daemon is involved, so these tests pin down what the
simulator does and not what devplug happens to send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.kubelet.registration import API_VERSION, CHECKPOINT_FILE, KUBELET_SOCKET
from devplug.naming import resource_name_problem
from devplug.testing.simulator import KubeletSimulator, ListedDevice

RESOURCE = "example.com/widget"
# What a test plugin's queue may hold: a list to send, END to return, or a status to abort with.
END = "end"


class RecordingPlugin(pb_grpc.DevicePluginServicer):
    """A minimal device plugin: records every call, streams what the test puts in ``lists``."""

    def __init__(
        self,
        *,
        preferred: bool = False,
        pre_start: bool = False,
        options_delay: float = 0.0,
    ) -> None:
        self.options = pb.DevicePluginOptions(
            pre_start_required=pre_start, get_preferred_allocation_available=preferred
        )
        self.options_delay = options_delay
        self.events: list[str] = []
        self.lists: asyncio.Queue[pb.ListAndWatchResponse | str] = asyncio.Queue()
        self.watch_opened = asyncio.Event()
        self.watch_closed = asyncio.Event()
        self.preferred_requests: list[pb.PreferredAllocationRequest] = []
        self.pre_start_requests: list[list[str]] = []

    def send(self, *devices: pb.Device) -> None:
        self.lists.put_nowait(pb.ListAndWatchResponse(devices=devices))

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        self.events.append("options")
        if self.options_delay:
            await asyncio.sleep(self.options_delay)
        return self.options

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        self.events.append("listandwatch")
        self.watch_opened.set()
        try:
            while True:
                item = await self.lists.get()
                if item == END:
                    return
                if isinstance(item, str):
                    await context.abort(grpc.StatusCode.INTERNAL, item)
                    return
                yield item
        finally:
            self.events.append("listandwatch-closed")
            self.watch_closed.set()

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        self.events.append("preferred")
        self.preferred_requests.append(request)
        answers = [
            pb.ContainerPreferredAllocationResponse(
                deviceIDs=list(c.available_deviceIDs)[: c.allocation_size]
            )
            for c in request.container_requests
        ]
        return pb.PreferredAllocationResponse(container_responses=answers)

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        self.events.append("allocate")
        return pb.AllocateResponse(
            container_responses=[pb.ContainerAllocateResponse() for _ in request.container_requests]
        )

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        self.events.append("prestart")
        self.pre_start_requests.append(list(request.devices_ids))
        return pb.PreStartContainerResponse()


def device(device_id: str, health: str = "Healthy", numa: tuple[int, ...] = ()) -> pb.Device:
    topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=n) for n in numa]) if numa else None
    return pb.Device(ID=device_id, health=health, topology=topology)


@contextlib.asynccontextmanager
async def serving(path: Path, plugin: RecordingPlugin) -> AsyncIterator[RecordingPlugin]:
    """Serve ``plugin`` on the unix socket ``path`` for the block's duration."""
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        yield plugin
    finally:
        await server.stop(None)


@contextlib.contextmanager
def bound_socket(path: Path) -> Iterator[None]:
    """A socket file at ``path`` with nobody listening on it (connect gets ECONNREFUSED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        yield


async def register(
    kubelet_dir: Path,
    *,
    endpoint: str,
    resource: str = RESOURCE,
    version: str = API_VERSION,
    timeout: float = 5.0,
) -> None:
    """A raw Registration.Register call on kubelet.sock; errors raise AioRpcError."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_dir / KUBELET_SOCKET}") as channel:
        request = pb.RegisterRequest(
            version=version,
            endpoint=endpoint,
            resource_name=resource,
            options=pb.DevicePluginOptions(),
        )
        await pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout)


async def refused(
    kubelet_dir: Path, *, endpoint: str, resource: str = RESOURCE, version: str = API_VERSION
) -> grpc.aio.AioRpcError:
    """Register, expecting the kubelet to refuse it; return the error."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await register(kubelet_dir, endpoint=endpoint, resource=resource, version=version)
    return caught.value


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


# 1. API version


async def test_wrong_api_version_is_refused_before_dialing(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with serving(kubelet_dir / "p.sock", RecordingPlugin()) as plugin:
        error = await refused(kubelet_dir, endpoint="p.sock", version="v1alpha")
    # A Go error returned from a gRPC handler reaches the client as UNKNOWN.
    assert error.code() == grpc.StatusCode.UNKNOWN
    details = error.details() or ""
    assert "v1alpha" in details and API_VERSION in details
    (registration,) = kubelet.registrations
    assert registration.version == "v1alpha" and registration.resource == RESOURCE
    assert not registration.accepted and registration.error == details
    assert kubelet.sessions == {}
    assert plugin.events == []  # the kubelet refuses before it dials back


# 2. Resource names


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("widget", "contains a '/'"),
        ("kubernetes.io/widget", "kubernetes.io namespace is reserved"),
        ("requests.example.com/widget", "must not start with 'requests.'"),
        ("Example.com/widget", "DNS-1123 subdomain"),
    ],
    ids=["no-slash", "native-namespace", "requests-prefix", "upper-case-domain"],
)
async def test_resource_names_the_kubelet_refuses(
    kubelet: KubeletSimulator, kubelet_dir: Path, name: str, rule: str
) -> None:
    async with serving(kubelet_dir / "p.sock", RecordingPlugin()) as plugin:
        error = await refused(kubelet_dir, endpoint="p.sock", resource=name)
    assert error.code() == grpc.StatusCode.UNKNOWN
    details = error.details() or ""
    problem = resource_name_problem(name)
    assert problem is not None and rule in problem
    assert repr(name) in details and problem in details
    (registration,) = kubelet.registrations
    assert registration.resource == name and not registration.accepted
    assert kubelet.sessions == {}
    assert plugin.events == []


# 3. Endpoints


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("sub/p.sock", "must be a file name"),
        ("../p.sock", "must be a file name"),
        ("..", "must be a file name"),
        ("", "must be a file name"),
        ("missing.sock", "does not exist"),
        ("regular.sock", "is not a unix socket"),
    ],
    ids=["slash", "dotdot-escape", "dotdot", "empty", "missing", "regular-file"],
)
async def test_endpoints_the_simulator_refuses(
    kubelet: KubeletSimulator, kubelet_dir: Path, endpoint: str, why: str
) -> None:
    # A live plugin behind the "/" and ".." endpoints, so only the name can be the reason.
    (kubelet_dir / "sub").mkdir()
    (kubelet_dir / "regular.sock").write_text("not a socket")
    inside = RecordingPlugin()
    outside = RecordingPlugin()
    async with (
        serving(kubelet_dir / "sub" / "p.sock", inside),
        serving(kubelet_dir.parent / "p.sock", outside),
    ):
        error = await refused(kubelet_dir, endpoint=endpoint)
    assert error.code() == grpc.StatusCode.UNKNOWN
    details = error.details() or ""
    assert why in details and repr(endpoint) in details
    (registration,) = kubelet.registrations
    assert registration.endpoint == endpoint and not registration.accepted
    assert kubelet.sessions == {}
    assert inside.events == [] and outside.events == []
    assert (kubelet_dir / "regular.sock").read_text() == "not a socket"


# 4. Dial-back


async def test_a_socket_nobody_serves_fails_to_dial(kubelet_dir: Path) -> None:
    async with KubeletSimulator(kubelet_dir, dial_timeout=0.5) as kubelet:
        with bound_socket(kubelet_dir / "dead.sock"):
            started = time.monotonic()
            error = await refused(kubelet_dir, endpoint="dead.sock")
            elapsed = time.monotonic() - started
        assert error.code() == grpc.StatusCode.UNKNOWN
        details = error.details() or ""
        assert "failed to dial" in details and "dead.sock" in details
        # It waited for the plugin (wait_for_ready) up to dial_timeout, not longer.
        assert 0.4 <= elapsed < 3.0
        (registration,) = kubelet.registrations
        assert not registration.accepted and registration.error == details
        assert kubelet.sessions == {}


# 5. Ordering: options before Register answers, then ListAndWatch


async def test_register_answers_after_the_options_then_listandwatch_is_recorded(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    # A slow GetDevicePluginOptions: a simulator that answered Register first would show here.
    plugin = RecordingPlugin(preferred=True, options_delay=0.2)
    async with serving(kubelet_dir / "p.sock", plugin):
        await register(kubelet_dir, endpoint="p.sock")
        assert plugin.events[:1] == ["options"] and plugin.events.count("options") == 1
        session = kubelet.sessions[RESOURCE]
        assert session.options.get_preferred_allocation_available
        assert not session.options.pre_start_required
        assert session.endpoint == kubelet_dir / "p.sock" and session.generation == 0
        (registration,) = kubelet.registrations
        assert registration.accepted and registration.error is None
        assert registration.endpoint == "p.sock" and registration.version == API_VERSION

        await asyncio.wait_for(plugin.watch_opened.wait(), 2)
        assert plugin.events == ["options", "listandwatch"]

        plugin.send(
            device("a", numa=(0,)),
            device("b", "Unhealthy", numa=(0, 1)),
            device("c"),
        )
        first = await session.wait_for_update(timeout=2)
        assert first == {
            "a": ListedDevice("a", "Healthy", (0,)),
            "b": ListedDevice("b", "Unhealthy", (0, 1)),
            "c": ListedDevice("c", "Healthy", ()),
        }
        assert session.healthy_ids() == {"a", "c"}

        plugin.send(device("a", "Unhealthy", numa=(0,)))
        second = await session.wait_for_update(after=1, timeout=2)
        assert second == {"a": ListedDevice("a", "Unhealthy", (0,))}

        plugin.send()  # an empty list is a list too: every device gone
        third = await session.wait_for_update(after=2, timeout=2)
        assert third == {}
        assert session.updates == [first, second, third]
        assert len(session.update_times) == 3
        assert session.update_times == sorted(session.update_times)
        assert session.latest == {} and session.healthy_ids() == set()
        assert not session.stream_ended.is_set()


# 6. Options gate the optional RPCs


async def test_optional_rpcs_are_refused_unless_the_plugin_offers_them(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    plugin = RecordingPlugin(preferred=False, pre_start=False)
    async with serving(kubelet_dir / "p.sock", plugin):
        await register(kubelet_dir, endpoint="p.sock")
        session = kubelet.sessions[RESOURCE]
        assert not session.options.get_preferred_allocation_available
        assert not session.options.pre_start_required
        with pytest.raises(AssertionError, match="GetPreferredAllocation"):
            await session.preferred(["a", "b"], 1)
        with pytest.raises(AssertionError, match="PreStartContainer"):
            await session.pre_start(["a"])
    assert "preferred" not in plugin.events and "prestart" not in plugin.events
    assert plugin.preferred_requests == [] and plugin.pre_start_requests == []


async def test_optional_rpcs_reach_a_plugin_that_offers_them(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    plugin = RecordingPlugin(preferred=True, pre_start=True)
    async with serving(kubelet_dir / "p.sock", plugin):
        await register(kubelet_dir, endpoint="p.sock")
        session = kubelet.sessions[RESOURCE]
        assert session.options.get_preferred_allocation_available
        assert session.options.pre_start_required
        assert await session.preferred(["a", "b", "c"], 2, must_include=["b"]) == ["a", "b"]
        await session.pre_start(["a"])
    (request,) = plugin.preferred_requests
    (container,) = request.container_requests
    assert list(container.available_deviceIDs) == ["a", "b", "c"]
    assert list(container.must_include_deviceIDs) == ["b"]
    assert container.allocation_size == 2
    assert plugin.pre_start_requests == [["a"]]


# 7. Re-registration


async def test_reregistration_replaces_the_session_and_ends_the_old_stream(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    old_plugin, new_plugin = RecordingPlugin(), RecordingPlugin()
    async with (
        serving(kubelet_dir / "old.sock", old_plugin),
        serving(kubelet_dir / "new.sock", new_plugin),
    ):
        await register(kubelet_dir, endpoint="old.sock")
        old = kubelet.sessions[RESOURCE]
        old_plugin.send(device("old0"))
        assert set(await old.wait_for_update(timeout=2)) == {"old0"}

        await register(kubelet_dir, endpoint="new.sock")
        new = kubelet.sessions[RESOURCE]
        assert new is not old and new.endpoint == kubelet_dir / "new.sock"
        assert await kubelet.wait_for_plugin(RESOURCE, replacing=old, timeout=1) is new
        # The old connection was closed before Register answered ...
        assert old.stream_ended.is_set()
        # ... and the old plugin sees its ListAndWatch end.
        await asyncio.wait_for(old_plugin.watch_closed.wait(), 2)
        assert old_plugin.events == ["options", "listandwatch", "listandwatch-closed"]
        with pytest.raises(AssertionError, match="ended"):
            await old.wait_for_update(lambda d: "never" in d, timeout=2)

        new_plugin.send(device("new0"))
        assert set(await new.wait_for_update(timeout=2)) == {"new0"}
        assert old.updates == [{"old0": ListedDevice("old0", "Healthy")}]
        assert [r.endpoint for r in kubelet.registrations] == ["old.sock", "new.sock"]
        assert all(r.accepted for r in kubelet.registrations)
        assert list(kubelet.sessions) == [RESOURCE]


# 8. restart()


async def test_restart_cleans_the_dir_like_a_kubelet_restart(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    checkpoint = kubelet_dir / CHECKPOINT_FILE
    checkpoint.write_text("checkpoint written by the old kubelet")
    (kubelet_dir / "notes.txt").write_text("not a socket")
    (kubelet_dir / "subdir").mkdir()
    plugin_path = kubelet_dir / "p.sock"
    with bound_socket(kubelet_dir / "stray.sock"):
        async with serving(plugin_path, RecordingPlugin()) as plugin:
            await register(kubelet_dir, endpoint="p.sock")
            old = kubelet.sessions[RESOURCE]
            await asyncio.wait_for(plugin.watch_opened.wait(), 2)
            assert is_socket(kubelet_dir / KUBELET_SOCKET)
            assert is_socket(plugin_path) and is_socket(kubelet_dir / "stray.sock")

            await kubelet.restart()

            assert kubelet.generation == 1
            assert kubelet.sessions == {} and old.stream_ended.is_set()
            await asyncio.wait_for(plugin.watch_closed.wait(), 2)
            # Every socket but kubelet.sock is gone; other files and the checkpoint stay.
            names = sorted(os.listdir(kubelet_dir))
            assert names == sorted([KUBELET_SOCKET, CHECKPOINT_FILE, "notes.txt", "subdir"])
            assert is_socket(kubelet_dir / KUBELET_SOCKET)
            assert checkpoint.read_text() == "checkpoint written by the old kubelet"
            assert (kubelet_dir / "notes.txt").read_text() == "not a socket"

    # The plugin comes back on a fresh socket and registers with the new kubelet.
    async with serving(plugin_path, RecordingPlugin()) as again:
        await register(kubelet_dir, endpoint="p.sock")
        session = await kubelet.wait_for_plugin(RESOURCE, timeout=1)
        assert session is not old and session.generation == 1
        await asyncio.wait_for(again.watch_opened.wait(), 2)
        again.send(device("d0"))
        assert set(await session.wait_for_update(timeout=2)) == {"d0"}
    assert [(r.generation, r.accepted) for r in kubelet.registrations] == [(0, True), (1, True)]
    assert old.generation == 0


# 9. wait_for_update ends instead of hanging


@pytest.mark.parametrize(
    ("ending", "recorded"),
    [(END, None), ("plugin broke", "INTERNAL: plugin broke")],
    ids=["stream-returns", "stream-aborts"],
)
async def test_wait_for_update_fails_when_the_stream_ends_first(
    kubelet: KubeletSimulator, kubelet_dir: Path, ending: str, recorded: str | None
) -> None:
    async with serving(kubelet_dir / "p.sock", RecordingPlugin()) as plugin:
        await register(kubelet_dir, endpoint="p.sock")
        session = kubelet.sessions[RESOURCE]
        plugin.send(device("d0"))
        await session.wait_for_update(timeout=2)
        started = time.monotonic()
        waiting = asyncio.create_task(
            session.wait_for_update(lambda d: "d1" in d, timeout=4), name="test-wait"
        )
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing matching yet: it waits ...
        plugin.lists.put_nowait(ending)
        # ... until the stream ends, then fails at once rather than running into the timeout.
        with pytest.raises(AssertionError, match="ListAndWatch ended") as failed:
            await waiting
        assert time.monotonic() - started < 2
        assert "got 1 lists" in str(failed.value)
        assert session.stream_error == recorded
        assert session.stream_ended.is_set()
        if recorded is not None:
            assert recorded in str(failed.value)
        # Asking again after the end fails straight away too.
        with pytest.raises(AssertionError, match="ListAndWatch ended"):
            await session.wait_for_update(lambda d: "d1" in d, timeout=4)
        # A list it already has is still found after the end.
        assert set(await session.wait_for_update(timeout=1)) == {"d0"}


async def test_wait_for_update_times_out_without_a_matching_list(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with serving(kubelet_dir / "p.sock", RecordingPlugin()) as plugin:
        await register(kubelet_dir, endpoint="p.sock")
        session = kubelet.sessions[RESOURCE]
        plugin.send(device("d0"))
        started = time.monotonic()
        with pytest.raises(TimeoutError) as waited:
            await session.wait_for_update(lambda d: "d1" in d, timeout=0.3)
        elapsed = time.monotonic() - started
        assert 0.25 <= elapsed < 2
        assert len(session.updates) == 1  # a list did arrive; it just did not match
        # The error says what was awaited and what came (no in-test daemon here to quote).
        assert str(waited.value).startswith(
            f"timed out after 0.3 s waiting for a ListAndWatch list of {RESOURCE} matching "
            "<lambda> at test_simulator.py:"
        )
        assert str(waited.value).endswith(": got 1 lists, the last with 1 devices (d0)")
        with pytest.raises(TimeoutError, match=r"list of \S+ \(list 2 or later\): got 1 lists"):
            await session.wait_for_update(after=1, timeout=0.1)
        # A list that matches within the timeout is returned.
        plugin.send(device("d0"), device("d1"))
        listed = await session.wait_for_update(lambda d: "d1" in d, timeout=2)
        assert set(listed) == {"d0", "d1"}
        assert not session.stream_ended.is_set()


async def test_waiting_for_a_refused_plugin_says_why_it_was_refused(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with serving(kubelet_dir / "p.sock", RecordingPlugin()):
        await refused(kubelet_dir, endpoint="p.sock", version="v1alpha")
        await refused(kubelet_dir, endpoint="missing.sock")
        with pytest.raises(TimeoutError) as waited:
            await kubelet.wait_for_plugin(RESOURCE, timeout=0.1)
        assert str(waited.value) == (
            f"timed out after 0.1 s waiting for {RESOURCE} to register with the kubelet "
            f"simulator in {kubelet_dir} (kubelet generation 0): 2 Register calls named it, the "
            f"last: generation 0: refused: {kubelet.registrations[0].error}; generation 0: "
            f"refused: {kubelet.registrations[1].error}"
        )
        with pytest.raises(TimeoutError) as counted:
            await kubelet.wait_for_registrations(3, timeout=0.1)
        assert str(counted.value) == (
            f"timed out after 0.1 s waiting for 3 Register calls to the kubelet simulator in "
            f"{kubelet_dir}: got 2, the last: {RESOURCE} refused; {RESOURCE} refused"
        )

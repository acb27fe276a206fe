"""devplug.testing.kubelet_dra: the kubelet DRA stand-in itself, against small plugins written
here that get things right or wrong on purpose (over real unix sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from devplug._proto import dra_v1_pb2 as v1
from devplug._proto import dra_v1beta1_pb2 as v1beta1
from devplug._proto import pluginregistration_v1_pb2 as reg
from devplug.testing import eventually
from devplug.testing.kubelet_dra import (
    CALL_TIMEOUT_S,
    GET_INFO,
    V1,
    V1BETA1,
    ClaimAnswer,
    ClaimName,
    KubeletDra,
    method_path,
)
from devplug.testing.simulator import SimulatorRpcError

DRIVER = "fake.devplug.example.com"
CLAIM = ClaimName("team-a", "uid-1", "c1")

Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]


class FakePlugin:
    """A registration socket in the registry dir and a DRA socket, on the kubelet's literal
    method paths (generic handlers, not the generated code); answers are the test's."""

    def __init__(
        self,
        registry: Path,
        plugin_dir: Path,
        *,
        socket_name: str = f"{DRIVER}-reg.sock",
        versions: tuple[str, ...] = (V1, V1BETA1),
        plugin_type: str = "DRAPlugin",
        name: str = DRIVER,
        endpoint: str | None = None,
        prepare: Handler | None = None,
    ) -> None:
        self.socket = registry / socket_name
        self.dra_socket = plugin_dir / "dra.sock"
        self.info = reg.PluginInfo(
            type=plugin_type,
            name=name,
            endpoint=str(self.dra_socket) if endpoint is None else endpoint,
            supported_versions=versions,
        )
        self.notifications: list[reg.RegistrationStatus] = []
        self.answering = asyncio.Event()
        self.answering.set()
        self.prepare_calls: list[str] = []
        self._prepare = prepare
        self._servers: list[grpc.aio.Server] = []

    async def _get_info(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        await self.answering.wait()
        return self.info

    async def _notify(
        self, request: reg.RegistrationStatus, context: Any
    ) -> reg.RegistrationStatusResponse:
        self.notifications.append(request)
        return reg.RegistrationStatusResponse()

    def _prepare_handler(self, pb: Any, path: str) -> Handler:
        async def handle(request: Any, context: Any) -> Any:
            self.prepare_calls.append(path)
            if self._prepare is not None:
                return await self._prepare(request, context)
            return pb.NodePrepareResourcesResponse(
                claims={c.uid: pb.NodePrepareResourceResponse() for c in request.claims}
            )

        return handle

    async def start(self) -> None:
        """The DRA socket first, then the registration socket, moved into place whole."""
        dra = grpc.aio.server()
        for pb, version in ((v1, V1), (v1beta1, V1BETA1)):
            path = method_path(version, "NodePrepareResources")
            service, _, method = path[1:].partition("/")
            handler = grpc.unary_unary_rpc_method_handler(
                self._prepare_handler(pb, path),
                request_deserializer=pb.NodePrepareResourcesRequest.FromString,
                response_serializer=pb.NodePrepareResourcesResponse.SerializeToString,
            )
            dra.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, {method: handler}),)
            )
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
        dra.add_insecure_port(f"unix://{self.dra_socket}")
        await dra.start()
        registration = grpc.aio.server()
        service, _, _ = GET_INFO[1:].partition("/")
        registration.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    service,
                    {
                        "GetInfo": grpc.unary_unary_rpc_method_handler(
                            self._get_info,
                            request_deserializer=reg.InfoRequest.FromString,
                            response_serializer=reg.PluginInfo.SerializeToString,
                        ),
                        "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                            self._notify,
                            request_deserializer=reg.RegistrationStatus.FromString,
                            response_serializer=reg.RegistrationStatusResponse.SerializeToString,
                        ),
                    },
                ),
            )
        )
        temporary = self.socket.parent / f".tmp-{self.socket.name}"
        registration.add_insecure_port(f"unix://{temporary}")
        await registration.start()
        os.rename(temporary, self.socket)
        self._servers = [registration, dra]

    async def stop(self) -> None:
        for server in self._servers:
            await server.stop(None)
        self._servers = []
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()


@pytest.fixture
def registry(short_dir: Path) -> Path:
    return short_dir / "plugins_registry"


@contextlib.asynccontextmanager
async def serving(plugin: FakePlugin) -> AsyncIterator[FakePlugin]:
    await plugin.start()
    try:
        yield plugin
    finally:
        await plugin.stop()


@contextlib.asynccontextmanager
async def kubelet_for(registry: Path, **options: Any) -> AsyncIterator[KubeletDra]:
    options.setdefault("health_interval_s", 0.1)
    async with KubeletDra(registry, **options) as kubelet:
        yield kubelet


def test_the_kubelets_method_paths_and_timeout() -> None:
    assert method_path(V1, "NodePrepareResources") == (
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    )
    assert method_path(V1BETA1, "NodeUnprepareResources") == (
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources"
    )
    assert GET_INFO == "/pluginregistration.Registration/GetInfo"
    assert CALL_TIMEOUT_S == 45.0
    assert KubeletDra(Path("/nonexistent")).call_timeout_s == 45.0


async def test_registers_a_good_plugin_and_calls_it_on_the_literal_paths(
    registry: Path, short_dir: Path
) -> None:
    async with kubelet_for(registry) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin")
        async with serving(plugin):
            session = await kubelet.wait_for_plugin(DRIVER)
            assert session.service == V1 and session.registration.accepted
            assert [n.plugin_registered for n in plugin.notifications] == [True]
            assert await kubelet.prepare(DRIVER, [CLAIM]) == {CLAIM.uid: ClaimAnswer((), "")}
            await kubelet.prepare(DRIVER, [CLAIM], version=V1BETA1)
            assert plugin.prepare_calls == [
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
                "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            ]


async def test_names_beginning_with_a_dot_and_plain_files_are_ignored(
    registry: Path, short_dir: Path
) -> None:
    registry.mkdir()
    (registry / "notes.sock").write_text("not a socket")
    hidden = FakePlugin(registry, short_dir / "hidden", socket_name=".hidden-reg.sock")
    visible = FakePlugin(registry, short_dir / "visible")
    async with serving(hidden), kubelet_for(registry) as kubelet, serving(visible):
        await kubelet.wait_for_plugin(DRIVER)
        rounds = kubelet.health_checks
        await eventually(lambda: kubelet.health_checks >= rounds + 2, timeout=10)
        assert [r.socket for r in kubelet.registrations] == [f"{DRIVER}-reg.sock"]
        assert hidden.notifications == []


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"plugin_type": "CSIPlugin"}, "plugin type 'CSIPlugin' is not 'DRAPlugin'"),
        ({"name": "Bad_Name"}, "invalid driver name 'Bad_Name'"),
        ({"endpoint": "plugins/dra.sock"}, "is not an absolute path"),
        ({"endpoint": "/nonexistent/dra.sock"}, "/nonexistent/dra.sock does not exist"),
        ({"versions": ()}, "empty list for supported versions"),
        ({"versions": (V1BETA1,)}, "v1.DRAPlugin is not among the supported versions"),
        ({"versions": ("v1alpha3.NodeService",)}, "v1.DRAPlugin is not among"),
    ],
)
async def test_a_wrong_plugin_info_is_refused_and_told_so(
    registry: Path, short_dir: Path, options: dict[str, Any], error: str
) -> None:
    async with kubelet_for(registry) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin", **options)
        async with serving(plugin):
            attempt = await kubelet.wait_for_registration(lambda r: True)
            assert not attempt.accepted and attempt.error is not None and error in attempt.error
            assert kubelet.plugins == {}
            assert [(n.plugin_registered, n.error) for n in plugin.notifications[:1]] == [
                (False, attempt.error)
            ]


async def test_the_first_entry_of_the_plugins_list_that_the_kubelet_knows_is_chosen(
    registry: Path, short_dir: Path
) -> None:
    async with kubelet_for(registry) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin", versions=(V1BETA1, V1))
        async with serving(plugin):
            assert (await kubelet.wait_for_plugin(DRIVER)).service == V1BETA1
    async with kubelet_for(registry, known_services=(V1BETA1,)) as old_kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin2", versions=(V1, V1BETA1))
        async with serving(plugin):
            session = await old_kubelet.wait_for_plugin(DRIVER)
            assert session.service == V1BETA1
            with pytest.raises(AssertionError, match="did not advertise v1alpha3"):
                await old_kubelet.prepare(DRIVER, [CLAIM], version="v1alpha3.NodeService")


async def test_a_plugin_that_stops_answering_is_deregistered_and_taken_back_later(
    registry: Path, short_dir: Path
) -> None:
    async with kubelet_for(registry, info_timeout_s=0.2) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin")
        async with serving(plugin):
            first = await kubelet.wait_for_plugin(DRIVER)
            plugin.answering.clear()
            gone = await kubelet.wait_for_deregistration(DRIVER)
            assert gone.reason == "GetInfo failed: DEADLINE_EXCEEDED"
            with pytest.raises(AssertionError, match="is not registered"):
                await kubelet.prepare(DRIVER, [CLAIM])
            plugin.answering.set()
            await kubelet.wait_for_plugin(DRIVER, replacing=first)


async def test_a_removed_socket_is_a_deregistration(registry: Path, short_dir: Path) -> None:
    async with kubelet_for(registry, health_interval_s=60) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin")
        async with serving(plugin):
            await kubelet.wait_for_plugin(DRIVER)
            plugin.socket.unlink()
            gone = await kubelet.wait_for_deregistration(DRIVER)
            assert gone.reason == "socket removed"


async def test_a_restart_forgets_every_plugin_and_finds_them_again(
    registry: Path, short_dir: Path
) -> None:
    async with kubelet_for(registry) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin")
        async with serving(plugin):
            before = await kubelet.wait_for_plugin(DRIVER)
            await kubelet.restart()
            assert kubelet.generation == 1
            after = await kubelet.wait_for_plugin(DRIVER, generation=1)
            assert after is not before and after.generation == 1
            assert [n.plugin_registered for n in plugin.notifications] == [True, True]


async def test_an_answer_that_skips_a_claim_fails_the_test(registry: Path, short_dir: Path) -> None:
    async def skip_all(request: Any, context: Any) -> Any:
        return v1.NodePrepareResourcesResponse()

    async with kubelet_for(registry) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin", prepare=skip_all)
        async with serving(plugin):
            await kubelet.wait_for_plugin(DRIVER)
            with pytest.raises(AssertionError, match=r"skipped 1 ResourceClaims \['uid-1'\]"):
                await kubelet.prepare(DRIVER, [CLAIM])


async def test_a_call_that_takes_too_long_ends_at_the_call_timeout(
    registry: Path, short_dir: Path
) -> None:
    never = asyncio.Event()

    async def hang(request: Any, context: Any) -> Any:
        await never.wait()
        raise AssertionError("unreachable")

    async with kubelet_for(registry, call_timeout_s=0.2) as kubelet:
        plugin = FakePlugin(registry, short_dir / "plugin", prepare=hang)
        async with serving(plugin):
            await kubelet.wait_for_plugin(DRIVER)
            with pytest.raises(SimulatorRpcError) as caught:
                await kubelet.prepare(DRIVER, [CLAIM])
            assert caught.value.code == "DEADLINE_EXCEEDED"

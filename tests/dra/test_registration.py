"""devplug.dra.registration: the registration socket and the DRA socket, as the kubelet's
plugin watcher finds them, over real unix sockets with the kubelet DRA stand-in."""

from __future__ import annotations

import os
import shutil
import socket
import stat
from pathlib import Path

import grpc
import pytest
from dra_plugin_env import DRIVER, FAST, plugin_env

from devplug._kits.socket_claim import SocketInUseError
from devplug._proto import pluginregistration_v1_pb2 as reg
from devplug.dra.checkpoint import CheckpointError
from devplug.dra.registration import KubeletPlugin, PluginPaths
from devplug.dra.sockets import SocketServer
from devplug.errors import ConfigError, InvalidNameError
from devplug.testing import eventually
from devplug.testing.kubelet_dra import (
    GET_INFO,
    NOTIFY_REGISTRATION_STATUS,
    V1,
    DraPluginSession,
)


async def raw_get_info(path: Path) -> reg.PluginInfo:
    """GetInfo on the kubelet's exact method path, over a plain channel."""
    async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
        call = channel.unary_unary(
            GET_INFO,
            request_serializer=reg.InfoRequest.SerializeToString,
            response_deserializer=reg.PluginInfo.FromString,
        )
        info: reg.PluginInfo = await call(reg.InfoRequest(), timeout=10)
        return info


async def test_get_info_names_the_driver_its_absolute_dra_socket_and_v1_first(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        info = await raw_get_info(env.paths.registration_socket)
        assert info.type == "DRAPlugin"
        assert info.name == DRIVER
        assert info.endpoint == f"{short_dir}/kubelet/plugins/{DRIVER}/dra.sock"
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert env.paths.registration_socket == Path(
            f"{short_dir}/kubelet/plugins_registry/{DRIVER}-reg.sock"
        )
        session = await env.kubelet.wait_for_plugin(DRIVER)
        assert session.registration.accepted and session.service == V1


async def test_the_kubelets_verdict_is_recorded_and_a_refusal_answered_with_an_error(
    short_dir: Path,
) -> None:
    async with plugin_env(short_dir) as env:
        assert env.plugin is not None
        await env.kubelet.wait_for_plugin(DRIVER)
        status = await env.plugin.registration.status.wait_for(lambda s: s is not None, 10)
        assert status is not None and (status.registered, status.error) == (True, "")

        async with grpc.aio.insecure_channel(f"unix://{env.paths.registration_socket}") as ch:
            notify = ch.unary_unary(
                NOTIFY_REGISTRATION_STATUS,
                request_serializer=reg.RegistrationStatus.SerializeToString,
                response_deserializer=reg.RegistrationStatusResponse.FromString,
            )
            refusal = reg.RegistrationStatus(plugin_registered=False, error="driver name taken")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await notify(refusal, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNKNOWN
        assert "driver name taken" in (caught.value.details() or "")
        status = env.plugin.registration.status.value
        assert status is not None and (status.registered, status.error) == (
            False,
            "driver name taken",
        )


async def test_both_sockets_are_0600_and_no_temporary_name_is_left(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        for path in (env.paths.registration_socket, env.paths.dra_socket):
            mode = os.lstat(path).st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, path
        for directory in (env.paths.registry_dir, env.paths.plugin_dir):
            assert not [n for n in os.listdir(directory) if n.startswith(".")], directory


async def test_the_kubelet_calls_get_info_again_as_a_health_check(short_dir: Path) -> None:
    async with plugin_env(short_dir, health_interval_s=0.05) as env:
        assert env.plugin is not None
        await env.kubelet.wait_for_plugin(DRIVER)
        first = env.plugin.registration.info_calls
        checks = env.kubelet.health_checks
        # Two rounds begun after the registration: the first of them has called GetInfo.
        await eventually(lambda: env.kubelet.health_checks >= checks + 2, timeout=10)
        assert env.plugin.registration.info_calls >= first + 1
        assert not env.kubelet.deregistrations


async def test_a_deleted_and_recreated_registry_dir_gets_the_socket_back(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        before = await env.kubelet.wait_for_plugin(DRIVER)
        shutil.rmtree(env.paths.registry_dir)
        gone = await env.kubelet.wait_for_deregistration(DRIVER)
        assert gone.reason == "socket removed"
        env.paths.registry_dir.mkdir()
        after = await env.kubelet.wait_for_plugin(DRIVER, replacing=before)
        assert after.registration.accepted
        assert stat.S_ISSOCK(os.lstat(env.paths.registration_socket).st_mode)
        assert await raw_get_info(env.paths.registration_socket)


async def test_a_removed_registration_socket_is_put_back(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        before = await env.kubelet.wait_for_plugin(DRIVER)
        env.paths.registration_socket.unlink()
        after = await env.kubelet.wait_for_plugin(DRIVER, replacing=before)
        assert after.registration.accepted


async def test_a_kubelet_restart_finds_the_socket_and_registers_it_again(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        await env.kubelet.restart()
        session = await env.kubelet.wait_for_plugin(DRIVER, generation=1)
        assert session.registration.accepted and session.generation == 1


async def test_stopping_removes_both_sockets_and_the_kubelet_deregisters(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        await env.stop_plugin()  # what the daemon's SIGTERM does to the plugin's task
        assert not env.paths.registration_socket.exists()
        assert not env.paths.dra_socket.exists()
        gone = await env.kubelet.wait_for_deregistration(DRIVER)
        assert gone.reason == "socket removed"


async def test_stopping_removes_the_registration_socket_while_the_dra_service_still_answers(
    short_dir: Path,
) -> None:
    # The kubelet deregisters the driver when its registration socket goes; until then it may
    # call the DRA socket, which must still be there and answer.
    async with plugin_env(short_dir) as env:
        session = await env.kubelet.wait_for_plugin(DRIVER)
        # A channel of its own: the stand-in closes the session's when it deregisters.
        caller = DraPluginSession(
            session.registration, session.registration_socket, session.identity, 10
        )
        assert env.plugin is not None
        registrar = env.plugin.registrar
        close_registrar = registrar.close
        seen: list[tuple[bool, bool, object]] = []

        async def close_and_look() -> None:
            await close_registrar()
            answer = await caller.prepare([])  # the DRA service, over its socket
            seen.append(
                (env.paths.registration_socket.exists(), env.paths.dra_socket.exists(), answer)
            )

        registrar.close = close_and_look  # type: ignore[method-assign]
        try:
            await env.stop_plugin()
        finally:
            await caller.channel.close(None)
            await caller.registration_channel.close(None)
        assert seen == [(False, True, {})]
        assert not env.paths.dra_socket.exists()


async def test_stopping_leaves_a_socket_someone_else_put_at_the_path(short_dir: Path) -> None:
    async with plugin_env(short_dir) as env:
        env.paths.registration_socket.unlink()
        foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            foreign.bind(str(env.paths.registration_socket))
            foreign.listen()
            await env.stop_plugin()
            assert stat.S_ISSOCK(os.lstat(env.paths.registration_socket).st_mode)
        finally:
            foreign.close()


async def test_a_live_socket_of_another_process_is_not_taken_over(short_dir: Path) -> None:
    path = short_dir / "dra.sock"
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    foreign.bind(str(path))
    foreign.listen()
    before = os.lstat(path).st_ino
    server = SocketServer(path, lambda _server: None)
    try:
        with pytest.raises(SocketInUseError, match="another process is serving"):
            await server.listen()
        assert os.lstat(path).st_ino == before
        assert not [n for n in os.listdir(short_dir) if n.startswith(".")]
    finally:
        await server.close()
        foreign.close()


async def test_a_stale_socket_at_the_dra_path_is_replaced(short_dir: Path) -> None:
    paths = PluginPaths.under(short_dir / "kubelet", DRIVER)
    paths.plugin_dir.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(paths.dra_socket))  # bound, never listening: what a killed process leaves
    stale.close()
    async with plugin_env(short_dir) as env:
        await env.kubelet.wait_for_plugin(DRIVER)
        assert env.plugin is not None and env.plugin.dra.intact()


async def test_an_unreadable_checkpoint_stops_the_plugin_before_it_serves(short_dir: Path) -> None:
    async with plugin_env(short_dir, start=False) as env:
        env.paths.plugin_dir.mkdir(parents=True)
        env.checkpoint_path.write_text('{"version": 99, "driver": "x", "claims": {}}')
        with pytest.raises(CheckpointError, match=r"version: 99 is not a checkpoint version"):
            await KubeletPlugin(env.paths, env.new_preparer(), timing=FAST).run()
        assert not env.paths.registration_socket.exists()
        assert not env.paths.dra_socket.exists()


def test_paths_refuse_a_relative_root_a_long_root_and_a_bad_driver(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as relative:
        PluginPaths.under(Path("var/lib/kubelet"), DRIVER)
    assert relative.value.field == "dra.kubelet_root" and "absolute" in relative.value.message
    with pytest.raises(ConfigError) as long:
        PluginPaths.under(Path("/" + "k" * 60), DRIVER)
    assert long.value.field == "dra.kubelet_root" and "107 bytes" in long.value.message
    with pytest.raises(InvalidNameError, match="DNS subdomain"):
        PluginPaths.under(Path("/var/lib/kubelet"), "Not_A_Driver")
    default = PluginPaths.under(Path("/var/lib/kubelet"), "gpu.intel.com")
    assert default.registration_socket == Path(
        "/var/lib/kubelet/plugins_registry/gpu.intel.com-reg.sock"
    )
    assert default.dra_socket == Path("/var/lib/kubelet/plugins/gpu.intel.com/dra.sock")

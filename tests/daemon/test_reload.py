"""SIGHUP reloads the config: a good one is applied (resources follow), a bad one is refused
with the field and the daemon goes on with the running one."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

import structlog
from helpers import PreferringScanner

from devplug.config import Settings
from devplug.errors import ConfigError
from devplug.model import DeviceInfo, DeviceNode
from devplug.scanners.base import Scanner
from devplug.testing import (
    KubeletSimulator,
    StaticScanner,
    daemon_process,
    daemon_settings,
    eventually,
    running_daemon,
)
from devplug.testing.harness import in_process_daemon

OLD = "example.com/old"
NEW = "example.com/new"


def one_device(resource: str) -> StaticScanner:
    return StaticScanner({resource: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})


async def test_a_good_config_is_applied_and_a_bad_one_refused(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    settings = daemon_settings(kubelet_dir)
    answers: list[tuple[Settings, Sequence[Scanner]] | ConfigError] = [
        ConfigError("scanners.generic[0].resource", "invalid resource name 'Serial'"),
        (settings, [one_device(NEW)]),
        (daemon_settings(kubelet_dir.parent / "elsewhere"), [one_device(NEW)]),
    ]

    def loader() -> tuple[Settings, Sequence[Scanner]]:
        answer = answers.pop(0)
        if isinstance(answer, ConfigError):
            raise answer
        return answer

    async with in_process_daemon(settings, [one_device(OLD)], config_loader=loader) as daemon:
        old = await kubelet.wait_for_plugin(OLD)
        await old.wait_for_update(lambda listed: set(listed) == {"dev0"})

        with structlog.testing.capture_logs() as logs:
            daemon.request_reload()
            await eventually(lambda: len(answers) == 2, timeout=10)  # the refused one was read
            await daemon.rescan()
        (refused,) = [e for e in logs if e["event"] == "config.reload.refused"]
        assert refused["field"] == "scanners.generic[0].resource"
        assert refused["log_level"] == "error" and daemon.stats.value.reloads == 0
        assert set(old.latest) == {"dev0"}  # still served
        assert (await old.allocate(["dev0"]))[0].nodes[0].host_path == "/dev/null"

        daemon.request_reload()
        new = await kubelet.wait_for_plugin(NEW)
        await new.wait_for_update(lambda listed: set(listed) == {"dev0"})
        await old.wait_for_update(lambda listed: listed == {})  # capacity drops at once
        assert daemon.stats.value.reloads == 1
        assert set(daemon.servers.servers) == {NEW}

        with structlog.testing.capture_logs() as logs:
            daemon.request_reload()
            await daemon.stats.wait_for(lambda s: s.reloads == 2, timeout=5)
        (warning,) = [e for e in logs if e["event"] == "config.reload.needs_restart"]
        assert warning["settings"] == ["kubelet_dir"]
        assert daemon.settings.kubelet_dir == kubelet_dir  # not applied while running


async def test_a_reload_asked_for_during_a_refused_one_is_applied_and_published(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """Two SIGHUPs, the second while the first reload reads a bad file: the loop runs the
    full scan both asked for right after the first (with the old scanners), then the second
    reload; that one's scan must still publish (it used to wait for the resync)."""
    settings = daemon_settings(kubelet_dir)
    reading = threading.Event()
    go = threading.Event()
    calls: list[int] = []

    def loader() -> tuple[Settings, Sequence[Scanner]]:
        calls.append(1)
        if len(calls) == 1:
            reading.set()
            assert go.wait(30)
            raise ConfigError("scanners.generic[0].resource", "invalid resource name 'Serial'")
        return settings, [one_device(NEW)]

    async with running_daemon(settings, [one_device(OLD)], config_loader=loader) as daemon:
        old = await kubelet.wait_for_plugin(OLD)
        await old.wait_for_update(lambda listed: set(listed) == {"dev0"})
        daemon.request_reload()
        assert await asyncio.to_thread(reading.wait, 30)
        daemon.request_reload()  # the good edit's SIGHUP, while the bad file is read
        go.set()
        new = await kubelet.wait_for_plugin(NEW)
        await new.wait_for_update(lambda listed: set(listed) == {"dev0"})
        await old.wait_for_update(lambda listed: listed == {})
        assert len(calls) == 2


async def test_sighup_reloads_the_config_file_of_devplug_run(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"

    def replace(text: str) -> None:
        # As editors and config management do: a reader never sees half a file.
        temp = config.with_suffix(".tmp")
        temp.write_text(text)
        temp.replace(config)

    def write(resource: str) -> None:
        replace(
            "hotplug: {source: none, poll_s: 3600, resync_s: 3600}\n"
            "scanners:\n  generic:\n"
            f"    - {{resource: {resource}, match: {{subsystem: mem, devnode: /dev/null}}}}\n"
        )

    write(OLD)
    async with daemon_process(config, kubelet_dir) as process:
        old = await kubelet.wait_for_plugin(OLD)
        await old.wait_for_update(lambda listed: set(listed) == {"null"})

        replace("scanners:\n  generic:\n    - {resource: Serial, match: {subsystem: mem}}\n")
        process.send_signal(signal.SIGHUP)
        write(NEW)  # a later, good edit
        process.send_signal(signal.SIGHUP)
        new = await kubelet.wait_for_plugin(NEW)
        await new.wait_for_update(lambda listed: set(listed) == {"null"})
        await old.wait_for_update(lambda listed: listed == {})
        process.terminate()
        _, err = await asyncio.wait_for(process.communicate(), 30)
    events = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "config.reloaded" in names
    refused = [e for e in events if e["event"] == "config.reload.refused"]
    # The two signals may be handled as one reload of the good file; a refusal, when the bad
    # file was read, names the field.
    assert all(e["field"] == "scanners.generic[0].resource" for e in refused), refused


async def test_a_config_the_host_cannot_be_served_with_is_refused_not_fatal(
    kubelet: KubeletSimulator, kubelet_dir: Path, host: object
) -> None:
    """A reload whose scanners refuse the host (Intel GPUs whose lists would pass the
    kubelet's 4 MiB) is refused like a bad file; the daemon does not stop."""
    from devplug.scanners.intel_gpu import IntelGpuScanner, IntelGpuSettings
    from devplug.scanners.intel_gpu.settings import max_shares_per_gpu
    from devplug.testing.umockdev import UmockdevHost, add_intel_gpu

    assert isinstance(host, UmockdevHost)
    for index in range(3):
        add_intel_gpu(host, f"0000:0{index + 3}:00.0", card=index, render=128 + index)
    settings = daemon_settings(kubelet_dir)
    too_many = IntelGpuScanner(IntelGpuSettings(shared_dev_num=max_shares_per_gpu(2)))
    loader = lambda: (settings, [too_many])  # noqa: E731 - one answer
    async with running_daemon(settings, [one_device(OLD)], config_loader=loader) as daemon:
        old = await kubelet.wait_for_plugin(OLD)
        await old.wait_for_update()
        with structlog.testing.capture_logs() as logs:
            daemon.request_reload()
            await eventually(
                lambda: any(e["event"] == "config.reload.refused" for e in logs), timeout=10
            )
        (refused,) = [e for e in logs if e["event"] == "config.reload.refused"]
        assert refused["field"] == "scanners.intel_gpu.shared_dev_num"
        assert daemon.stats.value.reloads == 0
        assert (await old.allocate(["dev0"]))[0].nodes[0].host_path == "/dev/null"


def ordered(reverse: bool) -> PreferringScanner:
    """Prefers the lowest ids, or with ``reverse`` the highest: a policy the default (which
    keeps the kubelet's order) would not pick."""
    devices = {f"dev{i}": DeviceInfo(nodes=(DeviceNode("/dev/null"),)) for i in range(4)}
    return PreferringScanner(
        {OLD: devices}, lambda available, _, size, __: sorted(available, reverse=reverse)[:size]
    )


async def test_a_reload_rebinds_the_hooks_of_resources_that_stay(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """The resource stays, its scanner is replaced: the servers answer with the new
    scanner's hooks (they used to keep the first scanner's until the resource went away)."""
    settings = daemon_settings(kubelet_dir)
    loader = lambda: (settings, [ordered(reverse=True)])  # noqa: E731 - one answer
    async with running_daemon(settings, [ordered(reverse=False)], config_loader=loader) as daemon:
        session = await kubelet.wait_for_plugin(OLD)
        available = ["dev2", "dev0", "dev3", "dev1"]
        assert await session.preferred(available, 1) == ["dev0"]
        with structlog.testing.capture_logs() as logs:
            daemon.request_reload()
            await daemon.stats.wait_for(lambda s: s.reloads == 1, timeout=5)
            await daemon.rescan()  # the scan after the reload has published; one more is fine
        assert await session.preferred(available, 1) == ["dev3"]
        assert [e["resource"] for e in logs if e["event"] == "server.hooks.rebound"] == [OLD]

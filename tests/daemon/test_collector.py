"""The daemon keeps what it holds for long out of the garbage collector's automatic passes
(devplug._kits.collector), without ever keeping garbage for good: a settle after each full
scan, once the CDI specs follow it, finds all garbage whenever it was frozen."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devplug._kits import collector
from devplug.testing import KubeletSimulator, daemon_process

RESOURCE = "example.com/null"


class _Node:
    """Something the collector tracks, that can point at itself."""

    me: _Node | None = None


@pytest.fixture
def thawed_afterwards() -> Iterator[None]:
    """The collector is the process's: leave nothing of these tests frozen."""
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.usefixtures("thawed_afterwards")
def test_a_settle_finds_a_cycle_frozen_earlier_and_freezes_what_is_alive() -> None:
    cycle = _Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    gc.freeze()  # alive when a settle froze it
    del cycle
    gc.collect()
    assert gone() is not None  # a plain collection leaves frozen garbage alone

    kept = _Node()
    settled = collector.settle()

    assert gone() is None
    assert settled.collected >= 1
    assert settled.frozen == gc.get_freeze_count() > 0
    # What was alive is frozen: the automatic passes no longer walk it.
    assert not any(found is kept for found in gc.get_objects())


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found


async def _until_logged(log: Path, name: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(_events(log, name)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} {name!r} lines not logged in {timeout:g} s")
        await asyncio.sleep(0.05)


def _config(devnode: str) -> str:
    return (
        "log_level: debug\n"
        "hotplug: {source: kernel, resync_s: 3600, poll_s: 3600}\n"
        "scanners:\n  generic:\n"
        f"    - {{resource: {RESOURCE}, match: {{subsystem: mem, devnode: {devnode}}}}}\n"
    )


async def test_devplug_run_settles_after_each_full_scan_once_its_spec_follows(
    kubelet: KubeletSimulator, kubelet_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(_config("/dev/null"))
    log = tmp_path / "daemon.log"
    async with daemon_process(config, kubelet_dir, output=log) as process:
        session = await kubelet.wait_for_plugin(RESOURCE)
        await session.wait_for_update(lambda listed: set(listed) == {"null"})
        await _until_logged(log, "daemon.collector.settled", 1)
        config.write_text(_config("/dev/zero"))  # another device: the spec is written again
        process.send_signal(signal.SIGHUP)  # a reload, then a full scan
        await session.wait_for_update(lambda listed: set(listed) == {"zero"})
        await _until_logged(log, "daemon.collector.settled", 2)

    lines = [json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{"]
    names = [line["event"] for line in lines]
    settles = [i for i, name in enumerate(names) if name == "daemon.collector.settled"]
    written = [i for i, name in enumerate(names) if name == "cdi.spec.written"]
    # Each settle after the CDI pass on its scan's tree: what the pass rendered is frozen too.
    assert len(written) >= 2 and written[0] < settles[0] < written[1] < settles[1]
    assert names.index("config.reloaded") < settles[1]
    # One settle per full scan: none for the events of the reload's own scan.
    assert len(settles) == 2
    # The modules the daemon imported alone are tens of thousands of objects.
    assert all(lines[i]["frozen"] > 10_000 and lines[i]["collected"] >= 0 for i in settles)

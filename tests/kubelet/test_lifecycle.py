"""Scanners' per-resource start and stop hooks, through the real daemon and kubelet simulator.

``start(resource)`` returns before the resource's first Register (its socket does not even
exist before), runs again only for a resource that was stopped (not after a kubelet restart),
and a failing or hung one keeps only its own resource unregistered, retried with back-off;
``stop(resource)`` runs after the kubelet got the resource's empty list and its server stopped,
and for every resource at shutdown.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from devplug import DeviceInfo, DeviceNode, ResourceStarter, ResourceStopper
from devplug.daemon import Daemon
from devplug.kubelet.server import socket_path_for
from devplug.testing import (
    FAST_TIMING,
    KubeletSimulator,
    StaticScanner,
    daemon_settings,
    running_daemon,
)
from devplug.testing.harness import in_process_daemon

GATED = "example.com/gated"
OTHER = "example.com/other"
INFO = DeviceInfo(nodes=(DeviceNode("/dev/null"),))


@dataclass(frozen=True, slots=True)
class Seen:
    """A hook call and what the kubelet simulator had seen of its resource at that moment."""

    hook: str
    resource: str
    registrations: int  # accepted Register calls for the resource so far
    latest: Mapping[str, object] | None  # the last list the kubelet got (None: no session)
    socket_exists: bool


class LifecycleScanner(StaticScanner):
    """Records every start/stop; ``gates[resource]`` holds a start until the test opens it,
    ``failures[resource]`` makes that many starts raise first."""

    def __init__(self, kubelet: KubeletSimulator, kubelet_dir: Path) -> None:
        super().__init__({GATED: {"a": INFO}, OTHER: {"b": INFO}})
        self.kubelet = kubelet
        self.kubelet_dir = kubelet_dir
        self.seen: list[Seen] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.failures: dict[str, int] = {}
        self.called = asyncio.Condition()

    def _record(self, hook: str, resource: str) -> None:
        session = self.kubelet.sessions.get(resource)
        self.seen.append(
            Seen(
                hook,
                resource,
                sum(r.accepted for r in self.kubelet.registrations if r.resource == resource),
                None if session is None else dict(session.latest),
                socket_path_for(self.kubelet_dir, resource).exists(),
            )
        )

    def calls(self, hook: str, resource: str) -> list[Seen]:
        return [s for s in self.seen if s.hook == hook and s.resource == resource]

    async def wait_calls(self, hook: str, resource: str, count: int) -> list[Seen]:
        async with asyncio.timeout(10), self.called:
            await self.called.wait_for(lambda: len(self.calls(hook, resource)) >= count)
        return self.calls(hook, resource)

    async def _note(self, hook: str, resource: str) -> None:
        self._record(hook, resource)
        async with self.called:
            self.called.notify_all()

    async def start(self, resource: str) -> None:
        await self._note("start", resource)
        gate = self.gates.get(resource)
        if gate is not None:
            await gate.wait()
        if self.failures.get(resource, 0) > 0:
            self.failures[resource] -= 1
            raise RuntimeError("firmware not loaded yet")
        await self._note("started", resource)

    async def stop(self, resource: str) -> None:
        await self._note("stop", resource)


def test_the_hooks_are_public_protocols() -> None:
    scanner = LifecycleScanner.__new__(LifecycleScanner)
    assert isinstance(scanner, ResourceStarter) and isinstance(scanner, ResourceStopper)
    assert not isinstance(StaticScanner(), ResourceStarter | ResourceStopper)


async def test_start_comes_before_register_and_stop_after_the_empty_list(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = LifecycleScanner(kubelet, kubelet_dir)
    scanner.gates[GATED] = asyncio.Event()
    settings = daemon_settings(kubelet_dir)
    async with in_process_daemon(settings, [scanner]) as daemon:
        # OTHER's start returns at once and it registers; GATED waits in its start, unseen.
        other = await kubelet.wait_for_plugin(OTHER)
        assert set(await other.wait_for_update()) == {"b"}
        (held,) = await scanner.wait_calls("start", GATED, 1)
        assert held.registrations == 0 and not held.socket_exists
        assert GATED not in kubelet.sessions
        assert daemon.servers.unregistered() == [GATED]

        scanner.gates[GATED].set()
        gated = await kubelet.wait_for_plugin(GATED)
        (returned,) = scanner.calls("started", GATED)
        assert returned.registrations == 0 and not returned.socket_exists

        # A kubelet restart re-registers both; neither is started again.
        await kubelet.restart()
        for resource in (GATED, OTHER):
            session = await kubelet.wait_for_plugin(resource, generation=1)
            await session.wait_for_update(lambda listed: len(listed) == 1)
        assert len(scanner.calls("start", GATED)) == len(scanner.calls("start", OTHER)) == 1

        # GATED leaves the tree: the kubelet gets its empty list, the server stops, then stop.
        gated = kubelet.sessions[GATED]
        scanner.set({OTHER: {"b": INFO}})
        await daemon.rescan()
        (stopped,) = await scanner.wait_calls("stop", GATED, 1)
        assert stopped.latest == {} and not stopped.socket_exists
        assert gated.latest == {}
        assert scanner.calls("stop", OTHER) == []

        # Back again: it was stopped, so it is started again before it registers again.
        registered = len(kubelet.registrations)
        scanner.set({GATED: {"a": INFO}, OTHER: {"b": INFO}})
        await daemon.rescan()
        again = (await scanner.wait_calls("started", GATED, 2))[1]
        assert again.registrations == stopped.registrations  # none since it was stopped
        assert not again.socket_exists
        await kubelet.wait_for_registrations(registered + 1)
    # At shutdown every resource still served is stopped, after its server.
    for resource in (GATED, OTHER):
        final = scanner.calls("stop", resource)[-1]
        assert not final.socket_exists
    assert len(scanner.calls("stop", GATED)) == 2
    assert len(scanner.calls("stop", OTHER)) == 1


async def test_a_failing_start_is_retried_and_keeps_only_its_resource_out(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = LifecycleScanner(kubelet, kubelet_dir)
    scanner.failures[GATED] = 3
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
            await kubelet.wait_for_plugin(OTHER)
            await kubelet.wait_for_plugin(GATED)
    # Four attempts, one Register, after the fourth.
    starts = scanner.calls("start", GATED)
    assert len(starts) == 4 and all(s.registrations == 0 for s in starts)
    assert [r.resource for r in kubelet.registrations].count(GATED) == 1
    failed = [e for e in logs if e["event"] == "lifecycle.start.failed"]
    # Logged with the reason when it appeared, not at every retry.
    assert [
        (e["resource"], e["reason"], e["log_level"]) for e in failed if e["log_level"] != "debug"
    ] == [(GATED, "RuntimeError: firmware not loaded yet", "warning")]
    assert all(e["retry_in_s"] > 0 for e in failed)
    complete = [e for e in logs if e["event"] == "lifecycle.start.complete"]
    assert {(e["resource"], e["attempts"]) for e in complete} == {(GATED, 4), (OTHER, 1)}
    # A start that never returned is not followed by a stop; both were stopped at shutdown.
    assert len(scanner.calls("stop", GATED)) == 1


class HungScanner(StaticScanner):
    """Its first start hangs (on the loop, or in its worker thread); later ones return."""

    def __init__(self, threaded: bool) -> None:
        super().__init__({GATED: {"a": INFO}})
        self.threaded = threaded
        self.calls = 0
        self.release = threading.Event()  # lets the hung thread go

    def start(self, resource: str) -> Any:
        self.calls += 1
        if self.threaded:
            if self.calls == 1:  # in a worker thread: hangs until released
                self.release.wait(30)
            return None
        return self._start_async()

    async def _start_async(self) -> None:
        if self.calls == 1:
            await asyncio.Event().wait()  # never set: only the timeout ends it


@pytest.mark.parametrize("threaded", [False, True], ids=["coroutine", "thread"])
async def test_a_hung_start_is_bounded_by_the_timeout_and_retried(
    kubelet: KubeletSimulator, kubelet_dir: Path, threaded: bool
) -> None:
    scanner = HungScanner(threaded)
    timing = replace(FAST_TIMING, hook_timeout_s=0.2)
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(
            daemon_settings(kubelet_dir), [scanner], timing=timing
        ) as daemon:
            if not threaded:
                # The hung coroutine is cancelled at the timeout; the retry returns.
                await kubelet.wait_for_plugin(GATED)
                assert scanner.calls == 2
            else:
                # A thread cannot be stopped: the retry waits for it rather than run beside
                # it, so it times out too (a retry that ran beside it would register).
                async with asyncio.timeout(10):
                    while _count(logs, "lifecycle.start.failed") < 2:
                        assert GATED not in kubelet.sessions
                        await asyncio.sleep(0.01)
                assert daemon.servers.unregistered() == [GATED]
                assert scanner.calls <= 1  # no second call beside the hung one
                scanner.release.set()
                await kubelet.wait_for_plugin(GATED)
                assert scanner.calls >= 2  # (more if a retry timed out on a slow host)
    failed = [e for e in logs if e["event"] == "lifecycle.start.failed"]
    assert "did not return within 0.2 s" in failed[0]["reason"]
    assert (failed[0]["resource"], failed[0]["log_level"]) == (GATED, "warning")


def _count(logs: Sequence[Mapping[str, Any]], event: str) -> int:
    return sum(e["event"] == event for e in logs)


class FailingStop(StaticScanner):
    def __init__(self) -> None:
        super().__init__({GATED: {"a": INFO}})

    def stop(self, resource: str) -> None:
        raise OSError(16, "Device or resource busy")


async def test_a_failing_stop_is_logged_and_the_daemon_stops_cleanly(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    daemon: Daemon
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(daemon_settings(kubelet_dir), [FailingStop()]) as daemon:
            await kubelet.wait_for_plugin(GATED)
    assert daemon.servers.servers == {}
    (failed,) = [e for e in logs if e["event"] == "lifecycle.stop.failed"]
    assert failed["resource"] == GATED and "Device or resource busy" in failed["reason"]
    assert any(e["event"] == "daemon.stopped" for e in logs)


async def test_a_resource_back_while_its_last_start_still_runs_waits_for_that_thread(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = HungScanner(threaded=True)
    timing = replace(FAST_TIMING, hook_timeout_s=0.3)
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner], timing=timing) as daemon:
        async with asyncio.timeout(10):
            while scanner.calls == 0:  # noqa: ASYNC110 - the hook runs in a thread
                await asyncio.sleep(0.01)
        # Withdrawn while its start hangs in a thread, then back.
        scanner.set({})
        await daemon.rescan()
        with structlog.testing.capture_logs() as logs:
            scanner.set({GATED: {"a": INFO}})
            await daemon.rescan()
            # Its new start waits for the old thread and times out, rather than run beside it
            # (which would register).
            async with asyncio.timeout(10):
                while _count(logs, "lifecycle.start.failed") < 1:
                    assert GATED not in kubelet.sessions
                    await asyncio.sleep(0.01)
        assert scanner.calls == 1
        scanner.release.set()
        await kubelet.wait_for_plugin(GATED)
        assert scanner.calls >= 2


class CancelledStart(StaticScanner):
    """Its first start raises CancelledError though nobody cancelled it (a coroutine's own
    inner timeout, a cancelled future it awaited), in the loop or in its worker thread."""

    def __init__(self, threaded: bool) -> None:
        super().__init__({GATED: {"a": INFO}})
        self.threaded = threaded
        self.calls = 0

    def start(self, resource: str) -> Any:
        if self.threaded:
            return self._start()
        return self._start_async()

    def _start(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise asyncio.CancelledError("the firmware loader's own wait")

    async def _start_async(self) -> None:
        self._start()


@pytest.mark.parametrize("threaded", [False, True], ids=["coroutine", "thread"])
async def test_a_start_hook_raising_cancelled_error_is_a_failure_logged_and_retried(
    kubelet: KubeletSimulator, kubelet_dir: Path, threaded: bool
) -> None:
    """Issue 25: the CancelledError went through the retry loop and ended the server's task
    silently: the resource was never served, and nothing said why."""
    scanner = CancelledStart(threaded)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
            await kubelet.wait_for_plugin(GATED)
    assert scanner.calls == 2
    (failed,) = [e for e in logs if e["event"] == "lifecycle.start.failed"]
    assert (failed["resource"], failed["log_level"], failed["attempt"]) == (GATED, "warning", 1)
    assert failed["reason"].startswith("CancelledError")
    assert "the firmware loader's own wait" in failed["reason"]


class SlowStop(StaticScanner):
    """A stop hook that never returns by itself (a coroutine: the timeout cancels it)."""

    def __init__(self) -> None:
        super().__init__({GATED: {"a": INFO}})

    async def stop(self, resource: str) -> None:
        await asyncio.Event().wait()


async def test_a_hung_stop_hook_at_shutdown_gets_what_is_left_of_the_stop_budget(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """Issue 25: a hung stop hook held the shutdown for the whole hook timeout (60 s, twice a
    pod's grace period). At shutdown it now gets the stop budget's rest, when that is less."""
    timing = replace(FAST_TIMING, hook_timeout_s=600.0)
    settings = daemon_settings(kubelet_dir, stop_timeout_s=2.0)
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(60):  # the hook timeout would be 600 s
            async with in_process_daemon(settings, [SlowStop()], timing=timing):
                await kubelet.wait_for_plugin(GATED)
    (failed,) = [e for e in logs if e["event"] == "lifecycle.stop.failed"]
    bound = float(failed["reason"].split("did not return within ")[1].split(" s")[0])
    assert 0 < bound <= 2.0, failed["reason"]
    assert [e["event"] for e in logs][-1] == "daemon.stopped"

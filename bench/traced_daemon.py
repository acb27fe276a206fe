"""``devplug run`` with a bench-only timing hook: where the time of each hotplug event goes.

Started by bench/hotplug_stages.py instead of ``python -m devplug``. Before handing over to
devplug's command line it wraps the functions each event passes through (nothing in
``src/`` changes) so that every call records ``(stage, start, end)`` on the system-wide
monotonic clock (``time.perf_counter``, which the bench process shares). The records are
written as JSON lines to the file named by ``DEVPLUG_TRACE`` when the daemon exits.

Stages, in the order an event meets them:

    read        UeventListener._on_readable       the monitor socket read on the loop
    take        UeventListener.take               end of the coalescing window
    scan        ScanRunner.scan                   the worker-thread round trip, all of:
    scan.thread ScanRunner.scan_blocking          ... the scan in the thread
    rescan      ScanRunner._rescan                ... the scanner's incremental re-read
    edit        DeviceTree.with_changes           ... the tree edit
    list_limit  ListLimit.fit                     ... the ListAndWatch size guard
    publish     Daemon._publish                   servers, metrics, CDI hand-over, stats
    gate        HealthGate.gate                   the health hold-down (before publish)
    apply       ResourceServers.apply             ... diff + pushing the new map
    diff        kubelet.servers.diff              ... the pure tree diff
    metrics     Metrics.set_devices               ... the devices gauge
    message     DevicePluginServicer._list_message  the stream's message (build + its size)
    build       ListMessageBuilder.build          ... the message build (encoded entries)
    serialize   the ListAndWatch response serializer (bytes pass through; grpc calls it)
    cdi.pass    carry_out                         a CDI pass's render and file I/O (after)
    cdi.render  SpecRenderer.render               ... its render, in a worker thread

With ``DEVPLUG_BENCH_QUIET_MS`` set, the scan loop's coalescing window (``asyncio.sleep`` in
devplug.hotplug.loop, through a stand-in for its ``asyncio``) ends once no datagram was read
for that long, or at its usual length, whichever comes first: a measure of the "window ends
when the burst does" proposal, without editing the module.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

RECORDS: list[tuple[str, float, float]] = []


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return await function(*args, **kwargs)
            finally:
                RECORDS.append((name, started, clock()))

        return timed_async

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return function(*args, **kwargs)
        finally:
            RECORDS.append((name, started, clock()))

    return timed


def _wrap(owner: Any, attribute: str, name: str) -> None:
    original = inspect.getattr_static(owner, attribute)
    if isinstance(original, staticmethod):
        setattr(owner, attribute, staticmethod(_timed(name, original.__func__)))
    else:
        setattr(owner, attribute, _timed(name, original))


LAST_READ = [0.0]


class _QuietAsyncio:
    """``asyncio`` for devplug.hotplug.loop, but ``sleep`` ends after a quiet gap."""

    def __init__(self, quiet_s: float) -> None:
        import asyncio

        self._asyncio = asyncio
        self._quiet_s = quiet_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._asyncio, name)

    async def sleep(self, delay: float) -> None:
        clock = time.perf_counter
        deadline = clock() + delay
        while True:
            now = clock()
            quiet_left = LAST_READ[0] + self._quiet_s - now
            if quiet_left <= 0 or now >= deadline:
                return
            await self._asyncio.sleep(min(quiet_left, deadline - now))


def install() -> None:
    import grpc

    from devplug import daemon, model
    from devplug.cdi import build, sync
    from devplug.hotplug import health, list_limit, listener, scanning
    from devplug.kubelet import servers, servicer, wire
    from devplug.ops import metrics

    _wrap(listener.UeventListener, "_on_readable", "read")
    quiet_ms = os.environ.get("DEVPLUG_BENCH_QUIET_MS")
    if quiet_ms:
        from devplug.hotplug import loop

        timed_read = listener.UeventListener._on_readable

        def read_noted(self: Any) -> None:
            timed_read(self)
            LAST_READ[0] = time.perf_counter()

        listener.UeventListener._on_readable = read_noted  # type: ignore[method-assign]
        setattr(loop, "asyncio", _QuietAsyncio(float(quiet_ms) / 1000))  # noqa: B010
    _wrap(listener.UeventListener, "take", "take")
    _wrap(scanning.ScanRunner, "scan", "scan")
    _wrap(scanning.ScanRunner, "scan_blocking", "scan.thread")
    _wrap(scanning.ScanRunner, "_rescan", "rescan")
    _wrap(model.DeviceTree, "with_changes", "edit")
    _wrap(list_limit.ListLimit, "fit", "list_limit")
    _wrap(health.HealthGate, "gate", "gate")
    _wrap(daemon.Daemon, "_publish", "publish")
    _wrap(servers.ResourceServers, "apply", "apply")
    servers.diff = _timed("diff", servers.diff)  # type: ignore[attr-defined]
    _wrap(metrics.Metrics, "set_devices", "metrics")
    _wrap(servicer.DevicePluginServicer, "_list_message", "message")
    _wrap(wire.ListMessageBuilder, "build", "build")
    _wrap(build.SpecRenderer, "render", "cdi.render")
    sync.carry_out = _timed("cdi.pass", sync.carry_out)  # type: ignore[attr-defined]

    plain = grpc.unary_stream_rpc_method_handler

    def unary_stream(
        behavior: Any, request_deserializer: Any = None, response_serializer: Any = None
    ) -> Any:
        if response_serializer is not None:
            response_serializer = _timed("serialize", response_serializer)
        return plain(behavior, request_deserializer, response_serializer)

    grpc.unary_stream_rpc_method_handler = unary_stream


def dump() -> None:
    path = os.environ.get("DEVPLUG_TRACE")
    if not path:
        return
    with open(path, "w") as out:
        for name, started, ended in RECORDS:
            out.write(json.dumps([name, started, ended]) + "\n")


if __name__ == "__main__":
    install()
    atexit.register(dump)
    from devplug.cli import main

    sys.exit(main(sys.argv[1:]))

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
    publish     ScanLoop._publish                 publication until delivered: servers, stats
    gate        HealthGate.gate                   the health hold-down (before publish)
    apply       ResourceServers.apply             ... diff + pushing the new map
    diff        kubelet.servers.diff              ... the pure tree diff
    metrics     Metrics.set_devices               ... the devices gauge
    message     DevicePluginServicer._list_message  the stream's message (build + its size)
    build       ListMessageBuilder.build          ... the message build (encoded entries)
    serialize   the ListAndWatch response serializer (bytes pass through; grpc calls it)
    cdi.pass    carry_out                         a CDI pass's render and file I/O (after)
    gc0..gc2    the daemon's garbage collections (gc.callbacks), by generation
    cdi.render  passes.render_in_slices           ... its render, in slices on the loop (the
                                                  waits between slices, for the hotplug
                                                  path's quiet, included)
"""

from __future__ import annotations

import atexit
import functools
import gc
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


def install() -> None:
    import grpc

    from devplug import model
    from devplug.cdi import passes, sync
    from devplug.hotplug import health, list_limit, listener, loop, scanning
    from devplug.kubelet import servers, servicer, wire
    from devplug.ops import metrics

    _wrap(listener.UeventListener, "_on_readable", "read")
    _wrap(listener.UeventListener, "take", "take")
    _wrap(scanning.ScanRunner, "scan", "scan")
    _wrap(scanning.ScanRunner, "scan_blocking", "scan.thread")
    _wrap(scanning.ScanRunner, "_rescan", "rescan")
    _wrap(model.DeviceTree, "with_changes", "edit")
    _wrap(list_limit.ListLimit, "fit", "list_limit")
    _wrap(health.HealthGate, "gate", "gate")
    _wrap(loop.ScanLoop, "_publish", "publish")
    _wrap(servers.ResourceServers, "apply", "apply")
    servers.diff = _timed("diff", servers.diff)  # type: ignore[attr-defined]
    _wrap(metrics.Metrics, "set_devices", "metrics")
    _wrap(servicer.DevicePluginServicer, "_list_message", "message")
    _wrap(wire.ListMessageBuilder, "build", "build")
    passes.render_in_slices = _timed("cdi.render", passes.render_in_slices)
    sync.carry_out = _timed("cdi.pass", sync.carry_out)  # type: ignore[attr-defined]

    collecting: list[float] = []

    def collected(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            RECORDS.append((f"gc{info['generation']}", collecting.pop(), time.perf_counter()))

    gc.callbacks.append(collected)

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

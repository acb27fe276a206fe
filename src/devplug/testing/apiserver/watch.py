"""One watch of the stand-in API server, as a real one streams it: status 200, chunked, one JSON
event per line (``{"type": ..., "object": ...}``).

From the real server (kubernetes/kubernetes ``staging/src/k8s.io/apiserver/pkg/storage/
cacher/``: ``cacher.go`` Watch, ``watch_cache.go`` getAllEventsSinceLocked): without a
resourceVersion (or with "0") the watch starts with an ADDED event for every matching object;
with one, it sends the events after it; one older than the kept history gets a single ERROR
event carrying a 410 Expired Status ("too old resource version: N (M)"); one newer than the
server's is refused with 504 before the stream starts. BOOKMARKs (when
``allowWatchBookmarks``) carry only the current resourceVersion. The stream ends cleanly
after ``timeoutSeconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from devplug._kits.values import LatestValue
from devplug.testing.apiserver.field_selectors import FieldSelector, selectable_fields
from devplug.testing.apiserver.http1 import Request, Responder
from devplug.testing.apiserver.status import SLICES, JsonObject, Kind, StatusError, bad_request
from devplug.testing.apiserver.store import Store


@dataclass(frozen=True, slots=True)
class WatchOptions:
    kind: Kind
    selector: FieldSelector
    resource_version: str
    timeout: float | None
    bookmarks: bool
    bookmark_interval: float


def too_large(asked: int, current: int) -> StatusError:
    """storage.NewTooLargeResourceVersionError: the client is ahead of this server."""
    return StatusError(
        504,
        "Timeout",
        f"Too large resource version: {asked}, current: {current}",
        {
            "causes": [
                {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
            ],
            "retryAfterSeconds": 1,
        },
    )


async def stream_watch(
    request: Request,
    responder: Responder,
    store: Store,
    options: WatchOptions,
    bookmark_requests: LatestValue[int],
) -> None:
    """Answer one watch request until its timeout, the client leaving, or cancellation."""
    since, initial = _start(store, options)
    await responder.start_stream(200, {"Content-Type": "application/json"})
    disconnected = asyncio.create_task(request.wait_disconnected(), name="apiserver.watch.client")
    try:
        for obj in initial:
            await _event(responder, "ADDED", obj)
        ended_here = await _follow(
            responder, store, options, since, bookmark_requests, disconnected
        )
    finally:
        # Stop reading before the last chunk: the client's next request on this connection
        # must reach the connection's loop, not this watch.
        disconnected.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await disconnected
    if ended_here:
        await responder.end_stream()


async def _follow(
    responder: Responder,
    store: Store,
    options: WatchOptions,
    since: int,
    bookmark_requests: LatestValue[int],
    disconnected: asyncio.Task[None],
) -> bool:
    """Send events after ``since`` as they come; True when the server ends the watch (timeout,
    410), False when the client left."""
    loop = asyncio.get_running_loop()
    deadline = None if options.timeout is None else loop.time() + options.timeout
    next_bookmark = loop.time() + options.bookmark_interval
    while True:
        changed_at = store.changed.version
        bookmarks_at = bookmark_requests.version
        try:
            events = store.events_since(since, options.kind)
        except StatusError as error:
            await _event(responder, "ERROR", error.status())
            return True
        for event in events:
            since = event.rv
            if options.selector.matches(selectable_fields(options.kind, event.object)):
                await _event(responder, event.type, event.object)
        now = loop.time()
        if deadline is not None and now >= deadline:
            return True
        if options.bookmarks and now >= next_bookmark:
            await _event(responder, "BOOKMARK", _bookmark(options.kind, store.rv))
            next_bookmark = now + options.bookmark_interval
        wake = [
            t - now
            for t in (deadline, next_bookmark if options.bookmarks else None)
            if t is not None
        ]
        outcome = await _first(
            disconnected,
            store.changed.wait_changed(changed_at),
            bookmark_requests.wait_changed(bookmarks_at),
            timeout=min(wake) if wake else None,
        )
        if outcome == "disconnected":
            return False
        if outcome == "bookmark" and options.bookmarks:
            await _event(responder, "BOOKMARK", _bookmark(options.kind, store.rv))


def _start(store: Store, options: WatchOptions) -> tuple[int, list[JsonObject]]:
    """Where the watch begins, and the synthetic ADDED objects it opens with."""
    text = options.resource_version
    if text in ("", "0"):
        return store.rv, store.items(options.kind, options.selector)
    try:
        asked = int(text)
    except ValueError:
        raise bad_request(f"invalid resource version: {text!r}") from None
    if asked > store.rv:
        raise too_large(asked, store.rv)
    return asked, []


async def _first(
    disconnected: asyncio.Task[None],
    changed: Coroutine[Any, Any, int],
    bookmark: Coroutine[Any, Any, int],
    timeout: float | None,
) -> str:
    """Which came first: "disconnected", "changed", "bookmark" or "timeout"."""
    waits = {
        asyncio.create_task(changed, name="apiserver.watch.changed"): "changed",
        asyncio.create_task(bookmark, name="apiserver.watch.bookmark"): "bookmark",
    }
    try:
        done, _ = await asyncio.wait(
            [disconnected, *waits], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    if disconnected in done:
        return "disconnected"
    for task, name in waits.items():
        if task in done:
            return name
    return "timeout"


def _bookmark(kind: Kind, rv: int) -> JsonObject:
    """An empty object of the watched kind with only the resourceVersion, as Go encodes one:
    the spec's required fields at their zero values."""
    obj: JsonObject = {
        "kind": kind.kind,
        "apiVersion": kind.api_version,
        "metadata": {"resourceVersion": str(rv)},
    }
    if kind == SLICES:
        obj["spec"] = {"driver": "", "pool": {"name": "", "generation": 0, "resourceSliceCount": 0}}
    return obj


async def _event(responder: Responder, type_: str, obj: JsonObject) -> None:
    line = json.dumps({"type": type_, "object": obj}, separators=(",", ":")) + "\n"
    await responder.chunk(line.encode())

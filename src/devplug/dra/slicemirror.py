"""This node's own ResourceSlices as the API server holds them: list, then watch.

:class:`SliceMirror` lists the slices of ``spec.driver=<driver>,spec.nodeName=<node>`` and
keeps the ones of this node's pool (the pool name is filtered here, not in the field selector:
a 1.34-1.36 API server refuses ``spec.pool.name`` as a field selector, and the reference helper
filters on the client side too, kubernetes/kubernetes#137413). It then follows a watch from
the list's resourceVersion; a watch that expired (410) lists again at once, one that broke
(API server gone) lists again after a back-off. Until a list has succeeded after a break the
mirror is not :attr:`~SliceMirror.synced`, and the publisher writes nothing on its word.

A watch is a long HTTP response, and a connection can go silent without closing (an API server
or load balancer failing over, a NAT entry dropped): nothing would ever arrive on it again, and
a wipe would never be seen. So every watch asks the server to end it after a random 5 to 10
minutes (``timeoutSeconds``, as client-go's reflector does), and is given up here a margin
after that, whatever the connection says; then the mirror lists again and watches anew. On a
healthy idle node that costs one list and one watch every 5 to 10 minutes, and no writes.

The publisher's own writes reach the mirror twice: from the write's answer
(:meth:`~SliceMirror.record`, :meth:`~SliceMirror.forget`), so that the next pass never
creates a slice a second time before the watch has shown it (what client-go's MutationCache
is for), and later as watch events. Events are ordered by resourceVersion per slice, so the
late echo of an older version never undoes a newer one. resourceVersions are opaque by the
API conventions, but every API server serves etcd revisions, integers; one that does not
parse is taken as newer, which costs at most one needless request.

:attr:`~SliceMirror.changes` moves only when the slices changed for another reason than this
publisher's writes (a wipe, someone else's edit, a new list that differs) or when
:attr:`~SliceMirror.synced` flips: the echo of a write made here wakes nobody, so an idle
pool makes no requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog
from devplug._kits.values import LatestValue
from devplug.dra.apiclient import (
    ApiStatusError,
    ApiUnreachableError,
    JsonObject,
    KubeApi,
    SliceList,
    WatchEvent,
)

log = structlog.get_logger(__name__)

EXPIRED = 410


def api_is_down(exc: BaseException) -> bool:
    """Whether ``exc`` says the API server is away or overloaded (retry later, say it once),
    rather than refusing this request (a problem of its own)."""
    if isinstance(exc, ApiUnreachableError):
        return True
    return isinstance(exc, ApiStatusError) and (exc.code >= 500 or exc.code == 429)


class ApiOutage:
    """One log line when the API server goes away and one when it is back, however many
    requests fail in between (each retry logs at debug only)."""

    def __init__(self) -> None:
        self._down_since: float | None = None

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, exc: BaseException, doing: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "dra.slices.api.unreachable", doing=doing, reason=str(exc), retry="with back-off"
            )
        else:
            log.debug("dra.slices.api.still_unreachable", doing=doing, reason=str(exc))

    def reached(self) -> None:
        if self._down_since is not None:
            away = time.monotonic() - self._down_since
            self._down_since = None
            log.info("dra.slices.api.reachable", after_s=round(away, 1))


def resource_version(obj: Mapping[str, Any]) -> int | None:
    """The object's resourceVersion as an integer, or None when it is not one."""
    value = obj.get("metadata", {}).get("resourceVersion")
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _newer(candidate: Mapping[str, Any], held: Mapping[str, Any] | None) -> bool:
    if held is None:
        return True
    new, old = resource_version(candidate), resource_version(held)
    return new is None or old is None or new > old


class SliceMirror:
    """The slices of this node's pool, by name, as last listed or watched."""

    def __init__(
        self,
        api: KubeApi,
        *,
        driver: str,
        node_name: str,
        pool: str,
        outage: ApiOutage,
        retry_initial_s: float,
        retry_max_s: float,
        watch_s: tuple[float, float] = (300.0, 600.0),
        watch_margin_s: float = 15.0,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._api = api
        self._watch_s = watch_s
        self._watch_margin_s = watch_margin_s
        self._on_change = on_change
        self._driver = driver
        self._node = node_name
        self._pool = pool
        self._outage = outage
        self._refusals = ProblemLog()
        self._retry = (retry_initial_s, retry_max_s)
        self._objects: dict[str, JsonObject] = {}
        # Slices this publisher deleted: name -> the resourceVersion it deleted. An event or a
        # list entry at or below it is from before the delete.
        self._deleted: dict[str, int] = {}
        self._synced = False
        self.changes: LatestValue[int] = LatestValue(0)
        self.lists = 0  # lists that succeeded (a test and the stats read it)
        self.deleted_elsewhere = 0  # slices seen deleted by someone else (a wipe, the GC)

    @property
    def objects(self) -> Mapping[str, JsonObject]:
        """The slices by name. Stored objects are never changed in place, so a shallow copy
        of this mapping is a consistent snapshot."""
        return self._objects

    @property
    def synced(self) -> bool:
        return self._synced

    async def wait_synced(self) -> None:
        await self.changes.wait_for(lambda _: self._synced)

    def record(self, obj: JsonObject) -> None:
        """A slice as a create or update of this publisher's returned it."""
        name = obj["metadata"]["name"]
        if _newer(obj, self._objects.get(name)):
            self._objects[name] = obj
            self._deleted.pop(name, None)

    def forget(self, obj: JsonObject) -> None:
        """A slice this publisher deleted (or found already gone)."""
        name = obj["metadata"]["name"]
        self._objects.pop(name, None)
        version = resource_version(obj)
        if version is not None:
            self._deleted[name] = version

    async def run(self) -> None:
        """List and watch until cancelled."""
        backoff = Backoff(*self._retry)
        expired_in_a_row = 0
        while True:
            try:
                listing = await self._api.list_slices(self._driver, self._node)
            except (ApiStatusError, ApiUnreachableError) as exc:
                self._broken(exc, "list")
                await asyncio.sleep(backoff.next())
                continue
            self._outage.reached()
            self._refusals.solved("list")
            self._replace(listing)
            try:
                await self._follow(listing.resource_version)
            except ApiStatusError as exc:
                if exc.code != EXPIRED:
                    self._broken(exc, "watch")
                    await asyncio.sleep(backoff.next())
                    continue
                # The history the watch started from is gone: list again, at once the first
                # time; a server that keeps answering 410 is not asked in a hot loop.
                expired_in_a_row += 1
                log.debug("dra.slices.watch.expired", resource_version=listing.resource_version)
                if expired_in_a_row > 1:
                    await asyncio.sleep(backoff.next())
                continue
            except ApiUnreachableError as exc:
                self._broken(exc, "watch")
                await asyncio.sleep(backoff.next())
                continue
            # The stream ended without an error (lightkube re-opens ended watches itself, so
            # this is a client that does not): list again.
            expired_in_a_row = 0
            backoff.reset()

    async def _follow(self, version: str) -> None:
        """Apply the watch's events until it ends or its time is up (then the caller lists
        again)."""
        lasting = random.uniform(*self._watch_s)
        events = self._api.watch_slices(
            self._driver, self._node, version, timeout_s=max(1, round(lasting))
        )
        try:
            async with asyncio.timeout(lasting + self._watch_margin_s):
                first = True
                async for event in events:
                    if first:
                        first = False
                        self._outage.reached()
                    self._apply(event)
        except TimeoutError:
            # Healthy (the server ended it and the client opened another) or silent: either
            # way a list now finds whatever was missed.
            log.debug("dra.slices.watch.renewed", after_s=round(lasting, 1))
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()  # the HTTP stream goes now, not when collected

    def _broken(self, exc: BaseException, doing: str) -> None:
        if api_is_down(exc):
            self._outage.failed(exc, doing)
        else:
            # Refused (403: RBAC; 400: a selector this server does not take): one line per
            # problem, not one per retry.
            event = "dra.slices.watch.refused" if doing == "watch" else "dra.slices.list.refused"
            self._refusals.report(log, event, str(exc), key=doing, retry="with back-off")
        self._set_synced(False)

    def _set_synced(self, synced: bool) -> None:
        if self._synced != synced:
            self._synced = synced
            self._bump()

    def _bump(self) -> None:
        self.changes.set(self.changes.value + 1)
        self._on_change()

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        return bool(obj.get("spec", {}).get("pool", {}).get("name") == self._pool)

    def _replace(self, listing: SliceList) -> None:
        """Take a list as the truth, but for what this publisher wrote after it was taken."""
        self.lists += 1
        listed_at = resource_version({"metadata": {"resourceVersion": listing.resource_version}})
        fresh: dict[str, JsonObject] = {}
        for obj in listing.items:
            name = obj["metadata"]["name"]
            gone_at = self._deleted.get(name)
            version = resource_version(obj)
            if gone_at is not None and version is not None and version <= gone_at:
                continue
            if self._ours(obj):
                fresh[name] = obj
        for name, held in self._objects.items():
            version = resource_version(held)
            written_after = listed_at is not None and version is not None and version > listed_at
            if name not in fresh and written_after:
                fresh[name] = held  # written here after the list's snapshot
        changed = fresh != self._objects
        self._objects = fresh
        if changed or not self._synced:
            self._synced = True
            self._bump()

    def _apply(self, event: WatchEvent) -> None:
        obj = event.object
        if not self._ours(obj):
            return
        name = obj["metadata"]["name"]
        held = self._objects.get(name)
        if event.type == "DELETED":
            if held is not None and _newer(obj, held):
                del self._objects[name]
                self.deleted_elsewhere += 1
                self._bump()
            return
        if event.type not in ("ADDED", "MODIFIED"):
            return
        gone_at, version = self._deleted.get(name), resource_version(obj)
        if gone_at is not None and version is not None and version <= gone_at:
            return
        if _newer(obj, held):
            self._objects[name] = obj
            self._deleted.pop(name, None)
            self._bump()

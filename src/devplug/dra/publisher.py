"""Publishing this node's pool as ResourceSlices, and keeping it published.

:class:`SlicePublisher` follows the advertised DeviceTree (a watchable latest value, or an
async iterator of trees) and the API server's slices of this node's pool
(:mod:`.slicemirror`: list, then watch), and after each change makes the second match the
first:

1. **Settle.** A change wakes it; it waits ``settle_s`` (0.15 s) from that first change, so
   a hotplug burst is published once, and then takes the latest tree: a storm of changes
   still publishes every ``settle_s`` or so, never falls behind. Nothing is published before
   the first tree, and nothing while the mirror is out of date (after a broken watch).
2. **Build.** The pool of the tree's DRA resources (:func:`~devplug.dra.slices.build_pool`),
   owned by the Node (its uid read at start and again after slices were deleted by
   someone else: a Node deleted and registered again has a new uid; nothing is published
   until it is known, as the reference helper does), each slice checked with the validator
   (:mod:`.screening`): a device it refuses is left out, the others go out. This runs in a
   worker thread: for 1,000 devices it is ~0.1 s of CPU that must not stall the event loop
   (the device-plugin front answers the kubelet on it). It is skipped when the DRA
   resources' devices are the same as in the previous pass.
3. **Plan** (:mod:`.slicediff`): the generation (bumped once per change of the pool's
   content) and the creates, PUTs and deletes. No request at all when nothing differs, so
   an idle node writes nothing.
4. **Write** (:mod:`.slicewrites`): deletes of obsolete slices (with the uid and
   resourceVersion seen as preconditions; 404 is fine), then creates and PUTs, concurrently
   (conditional on the resourceVersion seen; a 409 waits for the watch to show the newer
   slice, and the next pass tries again).

**Wipes.** The kubelet deletes every slice of its node when it starts, and a driver's slices
30 s after that driver's plugin disconnected (``DeleteCollection``; kubernetes/kubernetes
``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``, ``wipeResourceSlices``); the watch's
DELETED events wake the publisher, which writes the pool back, at the same generation when
its content did not change meanwhile.

**Failures.** While the API server is away (refused, reset, 5xx, 429) it retries with
exponential back-off and jitter (``retry_initial_s`` 0.5 s doubling to ``retry_max_s``
15 s), logging ``dra.slices.api.unreachable`` once and ``dra.slices.api.reachable`` when it
answers again. A slice the API server refuses (422: its rules are stricter than devplug's
mirror of them) is logged with the devices its causes name and counted, and sent again at once
without them (:mod:`.refusals`; without any device when the causes name none), so that the
pool keeps every slice its ``resourceSliceCount`` counts; an empty slice refused is not sent
again until it changes. The other slices go out meanwhile. Any other refusal (403 from RBAC or
the admission policy, ...) is logged once and retried with back-off.

**Stopping** (cancelling :meth:`~SlicePublisher.run`) deletes nothing: the kubelet wipes a
driver's slices itself 30 s after its plugin went away, and a daemon that restarts within
that time finds its pool as it left it and writes nothing, instead of making the pool vanish
and come back under the scheduler (the reference helper's ``Stop`` only stops its
controller either; a node that goes for good takes its slices with it through their owner
reference).

:attr:`~SlicePublisher.stats` holds counters for the metrics module; :attr:`published` the
pool as last published in full (what Prepare maps allocated device names through).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Collection, Hashable, Mapping
from dataclasses import dataclass, replace

import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog
from devplug._kits.values import LatestValue, Watchable
from devplug.dra.apiclient import ApiStatusError, ApiUnreachableError, JsonObject, KubeApi
from devplug.dra.naming import pool_name, validate_driver_name
from devplug.dra.screening import Screened, SliceScreen, SliceValidator
from devplug.dra.slicediff import Published, SlicePlan, plan_slices
from devplug.dra.slicemirror import ApiOutage, SliceMirror, api_is_down
from devplug.dra.slices import Omission, Pool, build_pool
from devplug.dra.slicewrites import SliceWriter, count
from devplug.dra.validate import validate_resource_slice
from devplug.model import DeviceTree

log = structlog.get_logger(__name__)

SETTLE_S = 0.15
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 15.0
WATCH_S = (300.0, 600.0)  # client-go's reflector: timeoutSeconds of 5 to 10 minutes
WATCH_MARGIN_S = 15.0


@dataclass(frozen=True, slots=True)
class PublishTiming:
    settle_s: float = SETTLE_S
    retry_initial_s: float = RETRY_INITIAL_S
    retry_max_s: float = RETRY_MAX_S
    # How long each watch of the slices lasts: a random time in this range, then a new list
    # and watch (a connection that went silent is given up a margin after it).
    watch_s: tuple[float, float] = WATCH_S
    watch_margin_s: float = WATCH_MARGIN_S


@dataclass(slots=True)
class PublishStats:
    """What the publisher has done, for metrics and status (read, never written, by them)."""

    generation: int = 0  # of the pool as last published in full
    slices: int = 0
    devices: int = 0
    publishes: int = 0  # passes that changed something at the API server
    writes: int = 0  # create, update and delete requests sent
    failures: int = 0  # of those, the ones that failed (rejected ones included)
    rejected: int = 0  # slices the API server refused as invalid (422)
    left_out: int = 0  # devices of the DRA resources not in the pool now (refused, odd)
    api_reachable: bool = True
    in_sync: bool = False  # the API server holds the pool as built from the latest tree
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class _Desired:
    pool: Pool  # at generation 0; the plan decides the generation
    screened: Screened


class SlicePublisher:
    """The ResourceSlices of one node-local pool, kept equal to the advertised tree."""

    def __init__(
        self,
        api: KubeApi,
        trees: Watchable[DeviceTree | None] | AsyncIterable[DeviceTree],
        *,
        node_name: str,
        driver: str,
        resources: Collection[str] | None = None,
        timing: PublishTiming | None = None,
        validator: SliceValidator = validate_resource_slice,
    ) -> None:
        self._api = api
        self._source = trees
        self._node = node_name
        self._pool_name = pool_name(node_name)  # raises on a bad name, before anything runs
        self._driver = validate_driver_name(driver)
        self._resources = None if resources is None else frozenset(resources)
        self._timing = timing or PublishTiming()
        self._screen = SliceScreen(validator)
        self._outage = ApiOutage()
        self._wake = asyncio.Event()
        self._mirror = SliceMirror(
            api,
            driver=driver,
            node_name=node_name,
            pool=self._pool_name,
            outage=self._outage,
            retry_initial_s=self._timing.retry_initial_s,
            retry_max_s=self._timing.retry_max_s,
            watch_s=self._timing.watch_s,
            watch_margin_s=self._timing.watch_margin_s,
            on_change=self._wake.set,
        )
        self._tree: LatestValue[DeviceTree | None] = LatestValue(None)
        self._writer = SliceWriter(api, self._mirror, self._outage)
        self._published: LatestValue[Pool | None] = LatestValue(None)
        self._node_uid: str | None = None
        self._known_uid: str | None = None  # the last uid read (kept while it is re-read)
        self._deletions_seen = 0
        self._last: Published | None = None
        self._built: tuple[object, _Desired] | None = None  # (what it was built from, result)
        self._omissions = ProblemLog()
        self._node_problem = ProblemLog()
        self._stats = PublishStats()

    @property
    def stats(self) -> PublishStats:
        self._stats.api_reachable = not self._outage.down
        return self._stats

    @property
    def published(self) -> Watchable[Pool | None]:
        """The pool as last published in full (None until then)."""
        return self._published

    def pool(self) -> Pool | None:
        """The pool as last published in full (what Prepare maps device names through)."""
        return self._published.value

    @property
    def mirror(self) -> SliceMirror:
        return self._mirror

    async def run(self) -> None:
        """Publish and keep publishing until cancelled; leaves the slices where they are."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow_trees(), name="dra-slices-trees")
            group.create_task(self._mirror.run(), name="dra-slices-watch")
            await self._reconcile()

    async def _follow_trees(self) -> None:
        source = self._source
        trees = source if isinstance(source, AsyncIterable) else source.as_changed()
        async for tree in trees:
            if tree is not None:
                self._tree.set(tree)
                self._wake.set()

    async def _reconcile(self) -> None:
        await self._tree.wait_for(lambda tree: tree is not None)
        backoff = Backoff(self._timing.retry_initial_s, self._timing.retry_max_s)
        while True:
            await asyncio.sleep(self._timing.settle_s)
            await self._mirror.wait_synced()
            self._wake.clear()  # a change from here on makes another pass
            tree = self._tree.value
            assert tree is not None
            try:
                retry = await self._pass(tree)
            except Exception as exc:  # a bug must not take the daemon's other fronts down
                log.exception("dra.slices.pass.failed", retry="with back-off")
                self._stats.last_error = repr(exc)
                retry = True
            delay = backoff.next() if retry else None
            if not retry:
                backoff.reset()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    async def _pass(self, tree: DeviceTree) -> bool:
        """One reconcile; True when something must be tried again."""
        if self._mirror.deleted_elsewhere != self._deletions_seen:
            # A wipe, or the garbage collector after the Node was deleted: a Node of the same
            # name that came back has another uid, and slices owned by the old one would be
            # collected again as soon as they are written back.
            self._deletions_seen = self._mirror.deleted_elsewhere
            self._node_uid = None
        if self._node_uid is None and not await self._read_node():
            return True
        stored = dict(self._mirror.objects)
        desired, plan = await asyncio.to_thread(self._prepare, tree, stored, self._last)
        self._report_left_out(desired)
        plan = self._writer.without_rejected(plan)
        results = await self._writer.write(plan)
        failed = [result for result in results if result.error is not None]
        retry = any(result.retry for result in failed)
        stats = self._stats
        stats.writes += len(results)
        stats.failures += len(failed)
        stats.rejected += sum(1 for result in failed if result.rejected)
        if failed:
            stats.last_error = f"{failed[-1].verb} {failed[-1].name}: {failed[-1].error}"
        written = len(results) - len(failed)
        if written or not plan.writes:
            # Something is at the plan's generation now (or already was): a later pass
            # compares with it, so a retry does not bump again.
            self._last = Published(plan.generation, plan.content)
        if written:
            stats.publishes += 1
            log.info(
                "dra.slices.published",
                generation=plan.generation,
                bumped=plan.bumped,
                slices=len(plan.slices),
                devices=len(desired.pool.devices) - len(desired.screened.refused),
                created=count(results, "create"),
                updated=count(results, "update"),
                deleted=count(results, "delete"),
                failed=len(failed),
            )
        if not retry:
            self._publish(desired, plan)
        stats.in_sync = not failed and not desired.screened.unsendable
        return retry

    async def _read_node(self) -> bool:
        try:
            node = await self._api.get_node(self._node)
        except (ApiStatusError, ApiUnreachableError) as exc:
            self._stats.last_error = f"reading Node {self._node}: {exc}"
            if api_is_down(exc):
                self._outage.failed(exc, "get node")
            else:
                self._node_problem.report(
                    log,
                    "dra.slices.node.unreadable",
                    str(exc),
                    key="node",
                    node=self._node,
                    fix="the node's name comes from NODE_NAME; the ServiceAccount needs get on "
                    "nodes",
                    retry="with back-off",
                )
            return False
        self._outage.reached()
        self._node_problem.solved("node")
        uid = str(node["metadata"]["uid"])
        if self._known_uid is not None and uid != self._known_uid:
            log.info("dra.slices.node.replaced", node=self._node, uid=uid, was=self._known_uid)
        self._node_uid = self._known_uid = uid
        return True

    def _prepare(
        self, tree: DeviceTree, stored: Mapping[str, JsonObject], last: Published | None
    ) -> tuple[_Desired, SlicePlan]:
        """Build, screen, take out what the API server refused before, and plan (in a
        worker thread: the pass awaits it, and nothing else changes what it reads meanwhile)."""
        wanted = self._resources
        basis = ({r: tree[r] for r in tree if wanted is None or r in wanted}, self._node_uid)
        if self._built is not None and self._built[0] == basis:
            desired = self._built[1]
        else:
            pool = build_pool(
                tree,
                node_name=self._node,
                driver=self._driver,
                generation=0,
                resources=wanted,
                node_uid=self._node_uid,
            )
            desired = _Desired(pool, self._screen(pool.slices))
            self._built = (basis, desired)
        if self._writer.refusals:
            desired = replace(desired, screened=self._writer.refusals.apply(desired.screened))
        hold = {name for name, _ in desired.screened.unsendable}
        return desired, plan_slices(desired.screened.slices, stored, last, hold=hold)

    def _report_left_out(self, desired: _Desired) -> None:
        """Say once what the pool leaves out and why (and again if it changes)."""
        current: set[Hashable] = set()
        for omission in desired.pool.omitted:
            key: Hashable = ("omitted", omission.resource, omission.device_id, omission.attribute)
            current.add(key)
            self._omissions.report(
                log,
                "dra.slices.device.omitted",
                omission.reason,
                key=key,
                level="warning",
                resource=omission.resource,
                device=omission.device_id,
                attribute=omission.attribute or None,
            )
        devices = desired.pool.devices
        for refused in desired.screened.refused:
            key = ("refused", refused.device)
            current.add(key)
            source = devices.get(refused.device)
            self._omissions.report(
                log,
                "dra.slices.device.refused",
                "; ".join(refused.problems),
                key=key,
                level="warning",
                device=refused.device,
                resource=source.resource if source else None,
                id=source.device_id if source else None,
                slice=refused.slice_name,
            )
        for name, problems in desired.screened.unsendable:
            key = ("unsendable", name)
            current.add(key)
            self._omissions.report(
                log, "dra.slices.slice.invalid", "; ".join(problems), key=key, slice=name
            )
        for old in self._omissions.unsolved():
            if old not in current:
                self._omissions.solved(old)

    def _publish(self, desired: _Desired, plan: SlicePlan) -> None:
        """Record the pool as now published: its devices but those refused or in slices that
        could not be sent."""
        kept: set[str] = set()
        unsent = {name for name, _ in desired.screened.unsendable} | self._writer.rejected
        for body in plan.slices:
            if body["metadata"]["name"] not in unsent:
                kept.update(device["name"] for device in body["spec"].get("devices", ()))
        pool = desired.pool
        refused = tuple(
            Omission(source.resource, source.device_id, "; ".join(r.problems))
            for r in desired.screened.refused
            if (source := pool.devices.get(r.device)) is not None
        )
        published = replace(
            pool,
            generation=plan.generation,
            slices=plan.slices,
            devices={name: device for name, device in pool.devices.items() if name in kept},
            omitted=pool.omitted + refused,
        )
        whole_devices = sum(1 for o in pool.omitted if not o.attribute)
        stats = self._stats
        stats.generation, stats.slices = plan.generation, len(plan.slices)
        stats.devices = len(published.devices)
        stats.left_out = whole_devices + len(pool.devices) - len(published.devices)
        if self._published.value != published:
            self._published.set(published)

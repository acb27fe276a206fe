"""Prepare and Unprepare: which of this node's devices a ResourceClaim was given, whether they
are free, and the answer the kubelet hands to the container runtime.

Prepare, for each claim the kubelet names (``{namespace, uid, name}``):

1. a claim already in the checkpoint gets the answer it got then (the kubelet asks again after
   its own restart; the answer must not change, and needs no API server);
2. read the claim (outside the lock, all of a batch at once: a slow read never holds up
   another batch); its uid must be the one asked for (else it was deleted and re-created) and
   it must be allocated;
3. keep the allocation results of this driver; each must name this node's pool;
4. map each device name to the devplug device through the pool as published now (the names
   the scheduler allocated from), and refuse one that is not healthy in the tree advertised
   now: the pool as published lags behind the node while the API server is away or a write
   is being retried, and a device that failed or was cordoned since must not be handed out;
5. refuse a device that another prepared claim holds, unless one of the two asked for
   ``adminAccess`` (the last line of defence: the scheduler should never do it);
6. require the CDI spec on disk to define the device (a runtime cannot resolve a CDI id whose
   spec is missing, and the container would fail later and more obscurely);
7. record the claim in the checkpoint, then answer with the same CDI ids the device-plugin
   front's Allocate names (``<vendor>/<class>=<id>``).

A claim that fails gets its own ``error`` and the others go on; a call fails as a whole only
when nothing could be done for any claim (the checkpoint cannot be written). Unprepare drops
claims from the checkpoint; a uid it does not know is already unprepared. Prepare and
Unprepare run one at a time (one asyncio.Lock), so two batches never pick the same device.

What this module is given rather than imports (the composition wires them): a claim reader
(the API client's ``get_claim``), the published pool, the devices as advertised now, and the
CDI ids the spec on disk defines (the CDI catalog knows).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import structlog

from devplug.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from devplug.dra.slices import PoolDevice
from devplug.model import DeviceInfo

T = TypeVar("T")

log = structlog.get_logger(__name__)


class ClaimReader(Protocol):
    """Reads a ResourceClaim from the API server as its wire JSON; raises when it cannot."""

    def __call__(self, namespace: str, name: str) -> Awaitable[Mapping[str, Any]]: ...


class PublishedPool(Protocol):
    """The pool as last published (:class:`devplug.dra.slices.Pool` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def devices(self) -> Mapping[str, PoolDevice]: ...


class AdvertisedDevice(Protocol):
    """A device as the advertised tree has it now (None: not advertised)."""

    def __call__(self, resource: str, device_id: str) -> DeviceInfo | None: ...


class CdiIds(Protocol):
    """The CDI ids of a device, as the spec on disk defines them now."""

    def cdi_device_ids(self, resource: str, device_id: str) -> Sequence[str]:
        """The fully qualified ids (``<vendor>/<class>=<name>``) that the resource's spec on
        disk defines for ``device_id``, as the device-plugin front's Allocate names them;
        empty while the spec does not define it (not written yet, deleted, out of date)."""
        ...


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Prepared:
    """One claim's answer: its devices, or why it could not be prepared."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class CallFailedError(Exception):
    """Nothing of a call could be done; the kubelet gets a gRPC error and asks again."""


# Told of every Prepare and Unprepare call: (operation: "prepare" or "unprepare", result: "ok",
# "claim_errors" when some claims got an error, "failed" when the call failed as a whole).
CallObserver = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class _Result:
    """One allocation result of this driver."""

    request: str  # the base name: "<request>" of "<request>/<subrequest>"
    device: str
    admin_access: bool
    share_id: str | None


class ClaimPreparer:
    """Prepare and Unprepare for one driver on one node."""

    def __init__(
        self,
        *,
        driver: str,
        pool_name: str,
        read_claim: ClaimReader,
        pool: Callable[[], PublishedPool | None],
        advertised: AdvertisedDevice,
        cdi: CdiIds,
        checkpoint: Checkpoint,
        observe: CallObserver | None = None,
        prepared: Mapping[str, PreparedClaim] | None = None,
    ) -> None:
        """``prepared``: the checkpoint's claims, when the caller read them already (the
        daemon does, at start: a checkpoint it cannot read stops it before anything serves);
        otherwise :meth:`load` reads them."""
        self.driver = driver
        self.pool_name = pool_name
        self.read_claim = read_claim
        self.pool = pool
        self.advertised = advertised
        self.cdi = cdi
        self.checkpoint = checkpoint
        self.observe = observe
        self._claims: dict[str, PreparedClaim] | None = None  # None until loaded
        if prepared is not None:
            self._claims = dict(prepared)
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        """Read the checkpoint (CheckpointError when it cannot be); again only if not yet."""
        async with self._lock:
            await self._loaded()

    async def _loaded(self) -> dict[str, PreparedClaim]:
        if self._claims is None:
            self._claims = await self.checkpoint.load()
            if self._claims:
                log.info("dra.checkpoint.loaded", claims=len(self._claims))
        return self._claims

    def prepared(self) -> Mapping[str, PreparedClaim]:
        """The prepared claims by uid (empty before :meth:`load`), for status and tests."""
        return dict(self._claims or {})

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, Prepared]:
        """An answer for every claim of ``refs`` by uid; CallFailedError when none could get
        one (the checkpoint could not be written)."""
        answers = await self._observed("prepare", self._prepare(refs))
        self._told("prepare", any(answer.error for answer in answers.values()))
        return answers

    async def _observed(self, operation: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except Exception:
            if self.observe is not None:
                self.observe(operation, "failed")
            raise

    def _told(self, operation: str, claim_errors: bool) -> None:
        if self.observe is not None:
            self.observe(operation, "claim_errors" if claim_errors else "ok")

    async def _prepare(self, refs: Sequence[ClaimRef]) -> dict[str, Prepared]:
        batch = {ref.uid: ref for ref in refs}
        known = self._claims or {}
        reads = await self._read_all([ref for ref in batch.values() if ref.uid not in known])
        async with self._lock:
            claims = await self._loaded()
            holders = _holders(claims)
            answers: dict[str, Prepared] = {}
            added: dict[str, PreparedClaim] = {}
            for uid, ref in batch.items():
                stored = claims.get(uid)
                if stored is not None:
                    answers[uid] = Prepared(stored.devices)
                    continue
                if uid not in reads:  # unprepared since the batch began: read it now
                    reads.update(await self._read_all([ref]))
                outcome = self._prepare_one(ref, reads[uid], holders)
                if isinstance(outcome, str):
                    log.warning("dra.claim.refused", claim=str(ref), uid=uid, reason=outcome)
                    answers[uid] = Prepared(error=outcome)
                    continue
                added[uid] = outcome
                for device in outcome.devices:
                    if not device.admin_access:
                        holders[(device.resource, device.device_id)] = outcome
                answers[uid] = Prepared(outcome.devices)
            if added:
                await self._record(claims, added, answers, whole_batch=len(added) == len(batch))
            return answers

    async def _record(
        self,
        claims: dict[str, PreparedClaim],
        added: Mapping[str, PreparedClaim],
        answers: dict[str, Prepared],
        *,
        whole_batch: bool,
    ) -> None:
        try:
            await self.checkpoint.save({**claims, **added})
        except OSError as exc:
            reason = f"cannot record the prepared claim in {self.checkpoint.path}: {exc}"
            log.error("dra.checkpoint.write_failed", reason=str(exc), claims=len(added))
            if whole_batch:
                raise CallFailedError(reason) from exc
            answers.update({uid: Prepared(error=reason) for uid in added})
            return
        claims.update(added)
        for claim in added.values():
            log.info(
                "dra.claim.prepared",
                claim=f"{claim.namespace}/{claim.name}",
                uid=claim.uid,
                devices=[f"{d.resource}={d.device_id}" for d in claim.devices],
            )

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """An error ("" for none) for every claim of ``refs`` by uid; an unknown uid is
        unprepared already. CallFailedError when the checkpoint could not be written."""
        answers = await self._observed("unprepare", self._unprepare(refs))
        self._told("unprepare", any(answers.values()))
        return answers

    async def _unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        uids = list(dict.fromkeys(ref.uid for ref in refs))
        async with self._lock:
            claims = await self._loaded()
            gone = [uid for uid in uids if uid in claims]
            answers = dict.fromkeys(uids, "")
            if not gone:
                return answers
            kept = {uid: claim for uid, claim in claims.items() if uid not in gone}
            try:
                await self.checkpoint.save(kept)
            except OSError as exc:
                reason = f"cannot record the unprepared claim in {self.checkpoint.path}: {exc}"
                log.error("dra.checkpoint.write_failed", reason=str(exc), claims=len(gone))
                if len(gone) == len(uids):
                    raise CallFailedError(reason) from exc
                answers.update(dict.fromkeys(gone, reason))
                return answers
            for uid in gone:
                claim = claims.pop(uid)
                log.info("dra.claim.unprepared", claim=f"{claim.namespace}/{claim.name}", uid=uid)
            return answers

    async def _read_all(self, refs: Sequence[ClaimRef]) -> dict[str, Mapping[str, Any] | str]:
        """Each claim as read, or why it could not be."""
        got = await asyncio.gather(*(self._read(ref) for ref in refs))
        return {ref.uid: claim for ref, claim in zip(refs, got, strict=True)}

    async def _read(self, ref: ClaimRef) -> Mapping[str, Any] | str:
        try:
            return await self.read_claim(ref.namespace, ref.name)
        except Exception as exc:  # any reader's failure is this claim's error, never the call's
            return f"cannot read {ref} from the API server: {exc}"

    def _prepare_one(
        self,
        ref: ClaimRef,
        claim: Mapping[str, Any] | str,
        holders: Mapping[tuple[str, str], PreparedClaim],
    ) -> PreparedClaim | str:
        """The claim as prepared, or why it cannot be."""
        if isinstance(claim, str):
            return claim
        results = self._results(ref, claim)
        if isinstance(results, str):
            return results
        pool = self.pool()
        devices: list[PreparedDevice] = []
        problems: list[str] = []
        for result in results:
            device = self._device(result, pool, holders)
            if isinstance(device, str):
                problems.append(device)
            else:
                devices.append(device)
        if problems:
            return f"{ref}: " + "; ".join(problems)
        return PreparedClaim(ref.namespace, ref.name, ref.uid, tuple(devices))

    def _results(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[_Result] | str:
        """This driver's allocation results of ``claim``, or why there are none to prepare."""
        uid = _get(claim, "metadata", "uid")
        if uid != ref.uid:
            return (
                f"{ref} has uid {uid!r}, not {ref.uid!r}: it was deleted and re-created "
                "since the pod was scheduled"
            )
        allocation = _get(claim, "status", "allocation")
        if not isinstance(allocation, Mapping):
            return f"{ref} is not allocated (status.allocation is missing)"
        raw = _get(allocation, "devices", "results") or []
        if not isinstance(raw, list):
            return f"{ref}: status.allocation.devices.results is not a list"
        results: list[_Result] = []
        problems: list[str] = []
        for index, result in enumerate(raw):
            where = f"status.allocation.devices.results[{index}]"
            if not isinstance(result, Mapping):
                problems.append(f"{where} is not an object")
                continue
            if result.get("driver") != self.driver:
                continue  # another driver's device: its own plugin prepares it
            request, device, pool = (result.get(k) for k in ("request", "device", "pool"))
            if pool != self.pool_name:
                problems.append(
                    f"{where} names pool {pool!r}, not this node's pool {self.pool_name!r}"
                )
                continue
            if not isinstance(request, str) or not isinstance(device, str):
                problems.append(f"{where} lacks its request or device name")
                continue
            share_id = result.get("shareID")
            results.append(
                _Result(
                    request=request.split("/", 1)[0],
                    device=device,
                    admin_access=result.get("adminAccess") is True,
                    share_id=share_id if isinstance(share_id, str) else None,
                )
            )
        if problems:
            return f"{ref}: " + "; ".join(problems)
        return results

    def _device(
        self,
        result: _Result,
        pool: PublishedPool | None,
        holders: Mapping[tuple[str, str], PreparedClaim],
    ) -> PreparedDevice | str:
        """One allocated device, prepared, or why it cannot be."""
        if pool is None:
            return f"device {result.device!r}: this node's pool is not published yet"
        found = pool.devices.get(result.device)
        if found is None:
            return (
                f"device {result.device!r} is not in this node's pool (generation "
                f"{pool.generation}): it was removed or became unhealthy since the claim was "
                "allocated"
            )
        resource, device_id = found.resource, found.device_id
        now = self.advertised(resource, device_id)
        if now is None:
            return (
                f"device {result.device!r} ({resource} {device_id}) is no longer advertised: "
                "it was removed after this node's pool was last published"
            )
        if not now.healthy:
            return (
                f"device {result.device!r} ({resource} {device_id}) is unhealthy: "
                f"{now.health_reason or 'no reason given'}; it leaves this node's pool at the "
                "next publish"
            )
        holder = holders.get((resource, device_id))
        if holder is not None and not result.admin_access:
            return (
                f"device {result.device!r} ({resource} {device_id}) is already prepared for "
                f"ResourceClaim {holder.namespace}/{holder.name} (uid {holder.uid}); it is "
                "handed out once unless adminAccess is asked for"
            )
        cdi_ids = tuple(self.cdi.cdi_device_ids(resource, device_id))
        if not cdi_ids:
            return (
                f"device {result.device!r}: the CDI spec of {resource} on disk does not define "
                f"{device_id} (yet): it is written when the device is found; check that the "
                "CDI dir is writable"
            )
        return PreparedDevice(
            request_names=(result.request,),
            pool_name=pool.name,
            device_name=result.device,
            cdi_device_ids=cdi_ids,
            share_id=result.share_id,
            resource=resource,
            device_id=device_id,
            admin_access=result.admin_access,
        )


def _holders(claims: Mapping[str, PreparedClaim]) -> dict[tuple[str, str], PreparedClaim]:
    """(resource, device id) -> the claim that holds it exclusively."""
    return {
        (device.resource, device.device_id): claim
        for claim in claims.values()
        for device in claim.devices
        if not device.admin_access
    }


def _get(obj: object, *path: str) -> object:
    """``obj[path[0]][path[1]]...``, or None where a step is missing or not an object."""
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj

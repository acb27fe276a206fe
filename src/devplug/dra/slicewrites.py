"""Carrying out a slice plan against the API server, and what each failure means.

:class:`SliceWriter` sends a :class:`~devplug.dra.slicediff.SlicePlan`'s requests: the deletes
first (with the uid and resourceVersion seen as preconditions; a slice already gone is fine),
as the reference helper does, so that devices the driver no longer has go even when the new
slices cannot be written; then the creates and PUTs, concurrently. Each answer goes into the
:class:`~devplug.dra.slicemirror.SliceMirror` at once, so the next pass never creates a slice
twice.

A failure is one of:

- **rejected**: the API server refused a slice to create or update as invalid (422), or the
  client could not send all of it: logged (``dra.slices.rejected``) with the devices its
  causes name. What was refused goes into :attr:`SliceWriter.refusals`
  (:mod:`.refusals`), and the publisher sends the slice again at once without it, so the
  pool keeps all its slices; an empty slice refused is not sent again with the same body
  (:meth:`SliceWriter.without_rejected`); a changed one is;
- **the API server away** (unreachable, 5xx, 429): told to the :class:`ApiOutage`, which
  logs once;
- **a conflict** (409, or 404 on a PUT): the slice changed since the watch showed it; the
  watch brings the newer one and the publisher tries again;
- **refused otherwise** (403 from RBAC or an admission policy, a DELETE an admission policy
  denies with 422): logged once per problem, tried again with back-off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from devplug._kits.problems import ProblemLog
from devplug.dra.apiclient import (
    ApiStatusError,
    ApiUnreachableError,
    JsonObject,
    KubeApi,
    StatusCause,
    UnsentFieldsError,
)
from devplug.dra.refusals import ApiRefusals
from devplug.dra.slicediff import SlicePlan, Update, normalised
from devplug.dra.slicemirror import ApiOutage, SliceMirror, api_is_down

log = structlog.get_logger(__name__)

INVALID = 422
NOT_FOUND = 404
CONFLICT = 409


@dataclass(frozen=True, slots=True)
class WriteResult:
    name: str  # the slice
    verb: str  # create, update, delete
    error: BaseException | None = None
    resend: bool = False  # rejected, and what was refused is known: send the rest again

    @property
    def rejected(self) -> bool:
        """A slice refused as it is: sending the same body again would be refused again.
        (A DELETE is never rejected so: an API server that refuses one as Invalid is an
        admission policy's denial, which may be lifted.)"""
        error = self.error
        if self.verb == "delete":
            return False
        return isinstance(error, UnsentFieldsError) or (
            isinstance(error, ApiStatusError) and error.code == INVALID
        )

    @property
    def retry(self) -> bool:
        """Failed for a reason that may pass, or rejected with what to leave out known:
        try again."""
        return self.error is not None and (self.resend or not self.rejected)


def count(results: Sequence[WriteResult], verb: str) -> int:
    """How many ``verb`` requests succeeded."""
    return sum(1 for result in results if result.verb == verb and result.error is None)


class SliceWriter:
    def __init__(self, api: KubeApi, mirror: SliceMirror, outage: ApiOutage) -> None:
        self._api = api
        self._mirror = mirror
        self._outage = outage
        self._rejected: dict[str, Any] = {}  # slice name -> the spec the API server refused
        self.refusals = ApiRefusals()  # what to leave out of the slices it refused
        self._refusals = ProblemLog()

    @property
    def rejected(self) -> frozenset[str]:
        """The slices whose latest body the API server refused."""
        return frozenset(self._rejected)

    def without_rejected(self, plan: SlicePlan) -> SlicePlan:
        """The plan less the bodies the API server refused before (no hot loop on a 422)."""
        if not self._rejected:
            return plan
        creates = tuple(body for body in plan.creates if not self._was_rejected(body))
        updates = tuple(u for u in plan.updates if not self._was_rejected(u.body))
        return replace(plan, creates=creates, updates=updates)

    async def write(self, plan: SlicePlan) -> list[WriteResult]:
        results = list(await asyncio.gather(*(self._delete(obj) for obj in plan.deletes)))
        writes = [self._create(body) for body in plan.creates]
        writes += [self._update(update) for update in plan.updates]
        results += await asyncio.gather(*writes)
        results = [self._failed(r, plan) if r.error is not None else r for r in results]
        if any(result.error is None or result.rejected for result in results):
            self._outage.reached()  # it answered
        return results

    def _was_rejected(self, body: JsonObject) -> bool:
        refused = self._rejected.get(body["metadata"]["name"])
        return refused is not None and refused == normalised(body["spec"])

    async def _delete(self, obj: JsonObject) -> WriteResult:
        meta = obj["metadata"]
        try:
            await self._api.delete_slice(
                meta["name"], uid=meta.get("uid"), resource_version=meta.get("resourceVersion")
            )
        except ApiStatusError as exc:
            if exc.code != NOT_FOUND:
                return WriteResult(meta["name"], "delete", exc)
        except ApiUnreachableError as exc:
            return WriteResult(meta["name"], "delete", exc)
        self._mirror.forget(obj)
        return WriteResult(meta["name"], "delete")

    async def _create(self, body: JsonObject) -> WriteResult:
        name = body["metadata"]["name"]
        try:
            self._mirror.record(await self._api.create_slice(body))
        except (ApiStatusError, ApiUnreachableError, UnsentFieldsError) as exc:
            return WriteResult(name, "create", exc)
        self._rejected.pop(name, None)
        return WriteResult(name, "create")

    async def _update(self, update: Update) -> WriteResult:
        name = update.body["metadata"]["name"]
        try:
            self._mirror.record(await self._api.replace_slice(update.body))
        except (ApiStatusError, ApiUnreachableError, UnsentFieldsError) as exc:
            return WriteResult(name, "update", exc)
        self._rejected.pop(name, None)
        return WriteResult(name, "update")

    def _failed(self, result: WriteResult, plan: SlicePlan) -> WriteResult:
        """Say what ``result``'s failure means, once; the result, marked when it is to be
        sent again without what was refused."""
        error = result.error
        assert error is not None
        if result.rejected:
            body = next(b for b in plan.slices if b["metadata"]["name"] == result.name)
            causes: tuple[StatusCause, ...] = getattr(error, "causes", ())
            resend = self.refusals.learn(body, causes, str(error))
            if not resend:
                self._rejected[result.name] = normalised(body["spec"])
            devices = _devices_named(body, [cause.field for cause in causes])
            retry = "when the pool changes"
            if resend:
                retry = "at once, without " + ("the devices named" if devices else "its devices")
            log.error(
                "dra.slices.rejected",
                slice=result.name,
                reason=str(error),
                devices=devices,
                causes=[f"{cause.field}: {cause.message}" for cause in causes],
                retry=retry,
            )
            return replace(result, resend=resend)
        if api_is_down(error):
            self._outage.failed(error, f"{result.verb} slice")
        elif isinstance(error, ApiStatusError) and error.code in (NOT_FOUND, CONFLICT):
            log.debug("dra.slices.conflict", slice=result.name, verb=result.verb, reason=str(error))
        else:
            self._refusals.report(
                log,
                "dra.slices.write.refused",
                str(error),
                key=result.verb,
                slice=result.name,
                verb=result.verb,
                retry="with back-off",
            )
            return result
        self._refusals.solved(result.verb)
        return result


def _devices_named(body: JsonObject, fields: list[str]) -> list[str]:
    """The names of the devices that ``fields`` (``spec.devices[3]...``) point at."""
    devices = body["spec"].get("devices") or []
    names = []
    for field in fields:
        if field.startswith("spec.devices["):
            index = field[len("spec.devices[") :].split("]", 1)[0]
            if index.isdigit() and int(index) < len(devices):
                names.append(str(devices[int(index)].get("name")))
    return sorted(set(names))

"""The DevicePlugin gRPC service for one resource.

Every handler reads one snapshot of the resource's devices, so an answer is always consistent
with one advertised list, even while the list changes underneath. Errors a request deserves
become gRPC statuses naming the ids; anything else is logged and answered INTERNAL, and the
server keeps serving.

Any local client that can open the socket is bounded: a container naming more ids than the
resource advertises (or a request of more than 1,024 containers) is refused before anything
is built for it; the default-answer cache is bounded in bytes; at most ``MAX_STREAMS``
ListAndWatch streams are open at once (the kubelet opens one); a stream that does not read
holds only the message in flight and gets the latest list when it reads again.
GetPreferredAllocation never fails a pod over a bogus request; large ones are taken two at a
time per resource, a third refused with RESOURCE_EXHAUSTED (see
:mod:`devplug.kubelet.preferring`, which also decides when its work leaves the event loop).
Refusals and failures are counted one by one in the metrics and logged at a bounded rate, per
kind of refusal: the first few distinct reasons in full, then one line per reason per
``REFUSAL_LOG_INTERVAL_S`` with how many more came (see :mod:`devplug._kits.repeats`).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import grpc
import structlog

from devplug._kits.problems import ProblemLog
from devplug._kits.repeats import RepeatLog
from devplug._kits.values import LatestValue
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.errors import AllocationError
from devplug.kubelet.allocation import check_request, check_size, default_allocation
from devplug.kubelet.answer_log import AnswerLog
from devplug.kubelet.answers import Answer, AnswerCache, loggable
from devplug.kubelet.preferring import PreferredAnswers
from devplug.kubelet.seams import AnswerExtension, NoServingEvents, ServingEvents
from devplug.kubelet.wire import ListMessageBuilder, allocate_response
from devplug.model import ContainerAllocation, DeviceMap, MapEdit
from devplug.scanners.base import Allocator, ContainerPreStarter, PostAllocator, PreferredAllocator

log = structlog.get_logger(__name__)

T = TypeVar("T")

# The service's full name in proto/ (package v1beta1).
SERVICE = "v1beta1.DevicePlugin"

_STATUS = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


# ListAndWatch streams one server keeps open at once: the kubelet opens one per registration;
# the margin covers a restarting kubelet's old stream and a debugging client.
MAX_STREAMS = 4
# Refused or failed calls after the first are logged as one line per this many seconds, with
# their count (a client repeating a bad request must not fill the node's disk).
REFUSAL_LOG_INTERVAL_S = 10.0


async def _resolve(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


def plugin_options(hooks: object | None) -> pb.DevicePluginOptions:
    """Options reflect the hooks: PreStartContainer only when the scanner implements it.

    GetPreferredAllocation is always available: the default policy (must-include, then NUMA)
    is better than the kubelet's own choice whenever devices carry topology.
    """
    return pb.DevicePluginOptions(
        pre_start_required=isinstance(hooks, ContainerPreStarter),
        get_preferred_allocation_available=True,
    )


class DevicePluginServicer:
    """The DevicePlugin service (served by :func:`devplug.kubelet.handlers.add_to_server`,
    not by the generated ``add_DevicePluginServicer_to_server``: ListAndWatch yields encoded
    messages)."""

    def __init__(
        self,
        resource: str,
        devices: LatestValue[DeviceMap],
        hooks: object | None,
        extension: AnswerExtension | None = None,
        events: ServingEvents | None = None,
    ) -> None:
        self.resource = resource
        self.extension = extension
        self.events = events if events is not None else NoServingEvents()
        self.devices = devices
        self.answer_cache = AnswerCache()  # default answers, encoded, per request
        self._log = log.bind(resource=resource)
        self.preferred = PreferredAnswers(resource, self._log)
        self.bind(hooks)
        self.refused_streams = 0
        self._stream_cap = ProblemLog()
        # The ListAndWatch message of the current snapshot, encoded (see ListMessageBuilder),
        # shared by every open stream.
        self._listed: tuple[DeviceMap, bytes] | None = None
        self._list_builder = ListMessageBuilder()
        self.active_streams = 0
        self.idle = asyncio.Event()  # set while no ListAndWatch stream is open
        self.idle.set()
        self.answer_log = AnswerLog(self._log)  # allocate.complete, once the answer is read
        # <rpc>.refused and <rpc>.failed: the first in full, then counted (see the module).
        self.refusal_log = RepeatLog(self._log, REFUSAL_LOG_INTERVAL_S)

    def bind(self, hooks: object | None) -> None:
        """Serve with ``hooks`` (the resource's scanner) from now on: at start, and when a
        reload replaces the scanner."""
        self.hooks = hooks
        self.options = plugin_options(hooks)
        # Protocol isinstance checks are slow (microseconds each): resolve the hooks once.
        self._allocator = hooks if isinstance(hooks, Allocator) else None
        self._post_allocator = hooks if isinstance(hooks, PostAllocator) else None
        self.preferred.hook = hooks if isinstance(hooks, PreferredAllocator) else None
        self._pre_starter = hooks if isinstance(hooks, ContainerPreStarter) else None
        self.answer_cache.invalidate()  # cached default answers were made under the old hooks

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return self.options

    def edited(self, devices: DeviceMap, edit: MapEdit) -> None:
        """``devices`` (about to be published) was made from ``edit.base`` by ``edit``: its
        message re-encodes only the devices the edit names."""
        self._list_builder.edited(devices, edit)

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, bytes],
    ) -> AsyncIterator[bytes]:
        """Each list as an encoded ListAndWatchResponse (sent as it is: see add_to_server)."""
        if self.active_streams >= MAX_STREAMS:
            self.refused_streams += 1
            # Once while the cap holds (then at debug): a flood of streams must not flood logs.
            self._stream_cap.report(
                self._log,
                "listandwatch.refused",
                f"{MAX_STREAMS} streams open",
                level="warning",
                field="state",
            )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.resource}: {MAX_STREAMS} ListAndWatch streams are open already",
            )
        self.active_streams += 1
        self.idle.clear()
        self._log.info("listandwatch.opened", streams=self.active_streams)
        try:
            sent: bytes | None = None
            async for devices in self.devices.as_changed():
                message = self._list_message(devices)
                if message is sent:
                    # Only what the kubelet does not see changed (a health reason, a mount):
                    # a flapping device's reasons must not become a stream of messages.
                    continue
                yield message
                sent = message
                self._log.debug("listandwatch.sent", devices=len(devices))
        finally:
            self.active_streams -= 1
            if self._stream_cap.solved():
                self._log.info("listandwatch.below_cap", refused=self.refused_streams)
            if not self.active_streams:
                self.idle.set()
            self._log.info("listandwatch.closed", streams=self.active_streams)

    def _list_message(self, devices: DeviceMap) -> bytes:
        if self._listed is None or self._listed[0] is not devices:
            message = self._list_builder.build(devices)
            if self._listed is None or message is not self._listed[1]:
                self.events.list_built(self.resource, len(message))
            self._listed = (devices, message)
        return self._listed[1]

    async def Allocate(
        self,
        request: tuple[bytes, pb.AllocateRequest],
        context: grpc.aio.ServicerContext[tuple[bytes, pb.AllocateRequest], bytes],
    ) -> bytes:
        """An encoded AllocateResponse (sent as it is: see devplug.kubelet.handlers). The
        request comes with its own bytes: a request seen before under the same snapshot,
        extension state and hooks is answered from the encoded-answer cache, with nothing
        parsed into lists, checked or built again."""
        raw, message = request
        devices = self.devices.value
        try:
            if self.extension is not None:
                self.extension.confirm(self.resource)  # e.g. never name a CDI spec that is gone
            generation = self.extension.generation if self.extension is not None else 0
            answer = self.answer_cache.lookup(raw, devices, generation)
            if answer is None:
                answer = await self._answer(raw, message, devices)
        except AllocationError as exc:
            self._refuse(context, "allocate", exc)
            return b""
        except Exception:
            self._fail(context, "allocate")
            return b""
        self.events.allocated(self.resource, "ok")
        self.answer_log.answered(answer.logged)
        return answer.encoded

    async def _answer(self, raw: bytes, message: pb.AllocateRequest, devices: DeviceMap) -> Answer:
        # Counted on the message, before any list is built for it.
        check_size(self.resource, [c.devices_ids for c in message.container_requests], devices)
        requests = [list(c.devices_ids) for c in message.container_requests]
        check_request(self.resource, requests, devices)
        state = self.answer_cache.state
        answer = Answer(
            allocate_response(await self._allocate(requests, devices)), loggable(requests)
        )
        # Only the default answers are kept (a hook's may depend on more than the request),
        # and only while the state they were made under holds.
        if self._allocator is None and self._post_allocator is None:
            self.answer_cache.keep(raw, answer, state)
        return answer

    async def _allocate(
        self, requests: Sequence[Sequence[str]], devices: DeviceMap
    ) -> Sequence[ContainerAllocation]:
        answers: Sequence[ContainerAllocation] | None = None
        if self._allocator is not None:
            answers = await _resolve(self._allocator.allocate(self.resource, requests, devices))
        if answers is None:
            answers = [
                self._extended(ids, default_allocation(ids, devices), devices) for ids in requests
            ]
        if self._post_allocator is not None:
            answers = await _resolve(
                self._post_allocator.post_allocate(self.resource, requests, answers)
            )
        _check_count(answers, requests)
        return answers

    def _extended(
        self, ids: Sequence[str], answer: ContainerAllocation, devices: DeviceMap
    ) -> ContainerAllocation:
        if self.extension is None:
            return answer
        return self.extension.extend(self.resource, ids, answer, devices)

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        try:
            answers = await self.preferred.answer(request.container_requests, self.devices.value)
        except AllocationError as exc:
            self._refuse(context, "preferred", exc)
            return pb.PreferredAllocationResponse()
        except Exception:
            self._fail(context, "preferred")
            return pb.PreferredAllocationResponse()
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(deviceIDs=chosen) for chosen in answers
            ]
        )

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        devices = self.devices.value
        try:
            check_size(self.resource, [request.devices_ids], devices)
            ids = list(request.devices_ids)
            check_request(self.resource, [ids], devices)
            if self._pre_starter is not None:
                await _resolve(self._pre_starter.pre_start_container(self.resource, ids))
        except AllocationError as exc:
            self._refuse(context, "prestart", exc)
        except Exception:
            self._fail(context, "prestart")
        return pb.PreStartContainerResponse()

    # A refusal or failure is answered by setting the call's status and returning an empty
    # response (which gRPC does not send with a status other than OK), not by
    # ``context.abort``: the exception abort raises is kept by the call's state, and its
    # traceback holds the handler's frames (the request, parsed and raw) in a reference
    # cycle that only the cyclic collector frees, and that collector does not count bytes:
    # 20 refused Allocates of 3 MB each, one after the other, would hold +390 MB.

    def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], rpc: str, exc: AllocationError
    ) -> None:
        """Answer with the refusal's gRPC status, naming the resource; log and count it."""
        self.answer_log.flush()  # earlier answers' lines before this refusal's
        self._count(rpc, exc.kind)
        event, reason = f"{rpc}.refused", str(exc)
        if self.refusal_log.admit(event, category=exc.kind, reason=reason):
            self._log.warning(event, reason=reason)
        context.set_code(_STATUS.get(exc.kind, grpc.StatusCode.INVALID_ARGUMENT))
        context.set_details(reason)

    def _fail(self, context: grpc.aio.ServicerContext[Any, Any], rpc: str) -> None:
        """Called while handling the exception: its traceback is logged, and the call is
        answered INTERNAL; the server goes on serving."""
        self.answer_log.flush()
        self._count(rpc, "error")
        event = f"{rpc}.failed"
        if self.refusal_log.admit(event, level="error", error=_error_name()):
            self._log.exception(event)
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details(f"{self.resource}: {rpc} failed")

    def _count(self, rpc: str, result: str) -> None:
        if rpc == "allocate":
            self.events.allocated(self.resource, result)


def _error_name() -> str:
    """The exception being handled, in a few words, for a summary line (no traceback)."""
    exc = sys.exc_info()[1]
    return "" if exc is None else f"{type(exc).__name__}: {exc}"[:200]


def _check_count(answers: Sequence[object], requests: Sequence[object]) -> None:
    if len(answers) != len(requests):
        raise RuntimeError(
            f"allocation hook returned {len(answers)} answers for {len(requests)} containers"
        )

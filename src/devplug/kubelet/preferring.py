"""GetPreferredAllocation's answers for one resource: the scanner's hook or the default policy,
kept within what the kubelet offered, and worked out on the event loop or in a worker thread.

Where the work runs is decided here, once, for the whole request: a request offering more
than :data:`PREFERRED_OFF_LOOP_IDS` ids in all (every container's ``available`` and
``must_include`` together) is answered in a worker thread, container by container, one
request at a time per resource; a smaller one on the loop (a thread costs more than it saves).
Counting per container would let a client spread ids over containers (190 containers of
2,000 ids each) and stall the loop for seconds. Off the loop, a scanner's plain-function hook
runs in the worker thread too; a hook that returns an awaitable (a coroutine function) has it
awaited on the loop, and what it picked is checked in the thread again. Cancelled (the client
went, the daemon stops), a request stops after the container under way.

Large requests are taken :data:`MAX_LARGE_PREFERRED` at a time per resource (the one being
answered and one waiting); one more is refused at once with ``AllocationError("exhausted")``
(RESOURCE_EXHAUSTED). Each waiting request holds its parsed message (about 20 MB for 190
containers of 2,000 ids), so an unbounded queue would let concurrent callers exhaust the
daemon's memory; the kubelet asks one GetPreferredAllocation at a time, so it never meets the
refusal unless another client floods the socket.

Nothing else here fails a pod over a bogus request or a broken hook: offered ids the resource
does not advertise are dropped when there are more of them than it advertises, and a hook that
raises or answers nonsense is logged and replaced by the default policy.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.errors import AllocationError
from devplug.kubelet.allocation import default_preferred
from devplug.model import DeviceMap
from devplug.scanners.base import PreferredAllocator

T = TypeVar("T")

# Above this many offered ids in one request (all its containers together), its answers are
# worked out in a worker thread: the default policy sorts and looks up each id, a few
# microseconds per id, and so may a hook.
PREFERRED_OFF_LOOP_IDS = 2000
# Large requests (those answered off the loop) held at once per resource: the one being
# answered and one waiting for it. A waiting request keeps its parsed message in memory.
MAX_LARGE_PREFERRED = 2


def offered_ids(containers: Sequence[pb.ContainerPreferredAllocationRequest]) -> int:
    """The ids a request offers, all containers together (what the work grows with)."""
    return sum(len(c.available_deviceIDs) + len(c.must_include_deviceIDs) for c in containers)


def advertised_only(ids: Sequence[str], devices: DeviceMap) -> list[str]:
    """``ids`` as a list; only the advertised ones when there are more ids than advertised
    devices (no real request offers that many: the kubelet offers what it was sent)."""
    if len(ids) <= len(devices):
        return list(ids)
    return [i for i in ids if i in devices]


@dataclass(frozen=True, slots=True)
class _Offer:
    """One container's request, its ids cut to what may be answered."""

    available: list[str]
    must_include: list[str]
    size: int


@dataclass(frozen=True, slots=True)
class _Awaiting:
    """A hook's answer still to be awaited on the loop."""

    offer: _Offer
    picked: Awaitable[object]


Runner = Callable[..., Awaitable[Any]]


async def _inline(function: Callable[..., T], *args: object) -> T:
    return function(*args)


class PreferredAnswers:
    """The preferred ids for each container of a request, for one resource."""

    def __init__(self, resource: str, logger: Any) -> None:
        self.resource = resource
        self.hook: PreferredAllocator | None = None
        self._log = logger
        # One off-loop request at a time, so big ones do not take every worker thread; the
        # one waiting here (see MAX_LARGE_PREFERRED) is cancelled at shutdown.
        self._off_loop = asyncio.Semaphore(1)
        self.large = 0  # large requests held: answered or waiting

    async def answer(
        self, containers: Sequence[pb.ContainerPreferredAllocationRequest], devices: DeviceMap
    ) -> list[list[str]]:
        """The preferred ids of each container. Raises AllocationError("exhausted") for a
        large request while :data:`MAX_LARGE_PREFERRED` are held already."""
        offered = offered_ids(containers)
        if offered <= PREFERRED_OFF_LOOP_IDS:
            return [await self._container(c, devices, _inline) for c in containers]
        if self.large >= MAX_LARGE_PREFERRED:
            raise AllocationError(
                "exhausted",
                f"{self.resource}: a request offering {offered} ids is refused while "
                f"{self.large} large GetPreferredAllocation requests are answered or waiting "
                "(the kubelet sends one at a time); try again later",
            )
        self.large += 1
        try:
            async with self._off_loop:
                return [await self._container(c, devices, asyncio.to_thread) for c in containers]
        finally:
            self.large -= 1

    async def _container(
        self, container: pb.ContainerPreferredAllocationRequest, devices: DeviceMap, run: Runner
    ) -> list[str]:
        step: list[str] | _Awaiting = await run(self._choose, container, devices)
        if not isinstance(step, _Awaiting):
            return step
        try:
            picked = await step.picked
        except Exception:
            self._hook_failed()
            fallback: list[str] = await run(
                self._default, step.offer, step.offer.must_include, devices
            )
            return fallback
        chosen: list[str] = await run(self._settle, step.offer, picked, devices)
        return chosen

    def _choose(
        self, container: pb.ContainerPreferredAllocationRequest, devices: DeviceMap
    ) -> list[str] | _Awaiting:
        offer = _Offer(
            advertised_only(container.available_deviceIDs, devices),
            advertised_only(container.must_include_deviceIDs, devices),
            container.allocation_size,
        )
        hook = self.hook
        if hook is None:
            return self._default(offer, offer.must_include, devices)
        try:
            picked = hook.preferred_allocation(
                self.resource, offer.available, offer.must_include, offer.size, devices
            )
        except Exception:
            self._hook_failed()
            return self._default(offer, offer.must_include, devices)
        if inspect.isawaitable(picked):
            return _Awaiting(offer, picked)
        return self._settle(offer, picked, devices)

    def _settle(self, offer: _Offer, picked: object, devices: DeviceMap) -> list[str]:
        """A hook's pick kept within what the kubelet offered, must-include first, healthy
        only; a short one topped up by the default policy."""
        try:
            if picked is None or isinstance(picked, str):
                raise TypeError(f"expected a list of device ids, got {picked!r:.200}")
            ids = cast(Iterable[Any], picked)  # iterating anything else raises: the default
            allowed = set(offer.available) | set(offer.must_include)
            chosen = list(
                dict.fromkeys(
                    [
                        *offer.must_include,
                        *(
                            i
                            for i in ids
                            if i in allowed and (i not in devices or devices[i].healthy)
                        ),
                    ]
                )
            )
        except Exception:
            self._hook_failed()
            return self._default(offer, offer.must_include, devices)
        if len(chosen) >= offer.size:
            return chosen[: max(offer.size, len(set(offer.must_include)))]
        return self._default(offer, chosen, devices)

    @staticmethod
    def _default(offer: _Offer, must_include: list[str], devices: DeviceMap) -> list[str]:
        return default_preferred(offer.available, must_include, offer.size, devices)

    def _hook_failed(self) -> None:
        """Called while handling the hook's exception: its traceback is logged. An error
        here would fail pod admission; the default is a safe answer."""
        self._log.exception("preferred.hook_failed")

"""GetPreferredAllocation's answers (devplug.kubelet.preferring): where the work runs is one
decision, by the ids of the whole request; hooks of either kind are kept within the offer;
large requests are held two at a time, and a refused request is freed when it is answered."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from devplug._kits.values import LatestValue
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.errors import AllocationError
from devplug.kubelet import preferring
from devplug.kubelet.allocation import default_preferred
from devplug.kubelet.handlers import add_to_server
from devplug.kubelet.preferring import (
    MAX_LARGE_PREFERRED,
    PREFERRED_OFF_LOOP_IDS,
    PreferredAnswers,
)
from devplug.kubelet.servicer import DevicePluginServicer
from devplug.model import DeviceInfo, DeviceMap

RESOURCE = "example.com/dev"
DEVICES = {f"dev{i}": DeviceInfo() for i in range(PREFERRED_OFF_LOOP_IDS)}
WAIT_S = 30.0


def request(*sizes: int) -> list[pb.ContainerPreferredAllocationRequest]:
    """One container per size, each offering that many ids."""
    return [
        pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=[f"dev{i}" for i in range(size)], allocation_size=1
        )
        for size in sizes
    ]


def on_loop() -> bool:
    return threading.current_thread() is threading.main_thread()


async def test_the_whole_request_decides_where_its_work_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran_on_loop: list[bool] = []
    policy = default_preferred

    def recording(*args: Any) -> list[str]:
        ran_on_loop.append(on_loop())
        return policy(*args)

    monkeypatch.setattr(preferring, "default_preferred", recording)
    answers = PreferredAnswers(RESOURCE, structlog.get_logger("test"))
    half = PREFERRED_OFF_LOOP_IDS // 2
    assert await answers.answer(request(half, half), DEVICES) == [["dev0"], ["dev0"]]
    assert ran_on_loop == [True, True]  # 2,000 ids in all: on the loop
    ran_on_loop.clear()
    # One id more, spread over containers that are each far below the bound: off the loop.
    assert await answers.answer(request(half, half, 1), DEVICES) == [["dev0"]] * 3
    assert ran_on_loop == [False, False, False]


class AsyncHook:
    """A coroutine-function hook that picks bogus, repeated and unhealthy ids among good ones."""

    def __init__(self) -> None:
        self.awaited_on_loop: list[bool] = []

    async def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str]:
        self.awaited_on_loop.append(on_loop())
        return ["not-offered", available[2], available[2], available[1]]


async def test_a_coroutine_hook_in_a_big_request_is_awaited_on_the_loop_and_kept_in_the_offer() -> (
    None
):
    hook = AsyncHook()
    answers = PreferredAnswers(RESOURCE, structlog.get_logger("test"))
    answers.hook = hook
    containers = request(PREFERRED_OFF_LOOP_IDS, 5)
    containers[1].allocation_size = 3
    containers[1].must_include_deviceIDs.append("dev4")
    got = await answers.answer(containers, DEVICES)
    assert got == [["dev2"], ["dev4", "dev2", "dev1"]]
    assert hook.awaited_on_loop == [True, True]


class BrokenHook:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    def preferred_allocation(self, *args: object) -> object:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer", [None, "dev1", 42, [["dev1"]], ValueError("broken")])
@pytest.mark.parametrize("sizes", [(3,), (PREFERRED_OFF_LOOP_IDS, 3)], ids=["loop", "thread"])
async def test_a_broken_hook_gets_the_default_answer_and_a_log_line(
    answer: object, sizes: tuple[int, ...]
) -> None:
    answers = PreferredAnswers(RESOURCE, structlog.get_logger("test"))
    answers.hook = BrokenHook(answer)  # type: ignore[assignment]
    with structlog.testing.capture_logs() as logs:
        got = await answers.answer(request(*sizes), DEVICES)
    assert got == [["dev0"]] * len(sizes)
    assert [e["event"] for e in logs] == ["preferred.hook_failed"] * len(sizes)


class HeldHook:
    """A plain-function hook whose first call, in its worker thread, waits until the test lets
    it go: the request under way stays held, and the next large one waits behind it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str]:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(WAIT_S)
        return list(available)[:size]


async def held_until_entered(hook: HeldHook, *calls: asyncio.Future[Any]) -> None:
    """Wait until the hook holds a request, failing early if a call ends first."""
    entered = asyncio.ensure_future(asyncio.to_thread(hook.entered.wait, WAIT_S))
    done, _ = await asyncio.wait({entered, *calls}, return_when=asyncio.FIRST_COMPLETED)
    assert entered in done and await entered, "no request reached the hook"


async def test_large_requests_are_held_two_at_a_time_and_one_more_is_refused() -> None:
    """Issue 25 review: each large request waiting for the off-loop slot kept its parsed
    message, with no bound on how many waited (50 concurrent requests of 190 x 2,000 ids:
    1.17 GB). Now one is answered and one waits; the next is refused (kind "exhausted",
    RESOURCE_EXHAUSTED on the wire) without waiting, and small ones are still answered."""
    hook = HeldHook()
    answers = PreferredAnswers(RESOURCE, structlog.get_logger("test"))
    answers.hook = hook
    big = request(PREFERRED_OFF_LOOP_IDS, 1)
    answered = asyncio.ensure_future(answers.answer(big, DEVICES))
    try:
        await held_until_entered(hook, answered)
        waiting = asyncio.ensure_future(answers.answer(big, DEVICES))
        await asyncio.sleep(0)  # it reaches the slot and waits there
        assert answers.large == MAX_LARGE_PREFERRED == 2
        for _ in range(3):
            with pytest.raises(AllocationError) as refused:
                await answers.answer(big, DEVICES)
            assert refused.value.kind == "exhausted"
            assert "2 large GetPreferredAllocation requests" in str(refused.value)
        assert await answers.answer(request(3), DEVICES) == [["dev0"]]  # small: on the loop
    finally:
        hook.release.set()
    assert await answered == [["dev0"], ["dev0"]]
    assert await waiting == [["dev0"], ["dev0"]]
    assert answers.large == 0
    assert await answers.answer(big, DEVICES) == [["dev0"], ["dev0"]]  # taken again


@contextlib.contextmanager
def cyclic_garbage() -> Iterator[list[object]]:
    """The objects that only the cyclic collector would free, of what runs in the block (the
    collector is off meanwhile, as it is between its runs, which count objects, not bytes)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[object] = []
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@contextlib.asynccontextmanager
async def served(
    short_dir: Path, devices: DeviceMap, hooks: object
) -> AsyncIterator[tuple[DevicePluginServicer, Any]]:
    """The servicer on a real gRPC server and unix socket, and a client's stub."""
    servicer = DevicePluginServicer(RESOURCE, LatestValue(devices), hooks)
    server = grpc.aio.server()
    add_to_server(servicer, server)
    server.add_insecure_port(f"unix://{short_dir / 'plugin.sock'}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_dir / 'plugin.sock'}") as channel:
            yield servicer, pb_grpc.DevicePluginStub(channel)
    finally:
        await server.stop(None)


async def test_concurrent_large_preferred_requests_are_refused_and_hold_no_memory(
    short_dir: Path,
) -> None:
    """A probe of the review's attack over a real socket: 10 concurrent large requests (20
    containers of 2,000 ids each) while the first is held in its hook. Two are held (one
    answered, one waiting), the other eight are refused with RESOURCE_EXHAUSTED at once, and
    none of the refused leaves its request to the cyclic collector: each is freed when it is
    answered (``context.abort`` left the request in a reference cycle with the call's state:
    20 refused Allocates of 3 MB one after another held 390 MB)."""
    hook = HeldHook()
    parallel = 10
    ids = list(DEVICES)
    big = pb.PreferredAllocationRequest(container_requests=request(*[len(ids)] * 20))
    async with served(short_dir, DEVICES, hook) as (servicer, stub):
        with cyclic_garbage() as garbage:
            first = asyncio.ensure_future(stub.GetPreferredAllocation(big))
            try:
                await held_until_entered(hook, first)
                rest = [asyncio.ensure_future(stub.GetPreferredAllocation(big)) for _ in range(9)]
                codes = await refusals(rest, parallel - MAX_LARGE_PREFERRED)
                assert servicer.preferred.large == MAX_LARGE_PREFERRED
            finally:
                hook.release.set()
            answered = await asyncio.gather(first, *rest, return_exceptions=True)
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (parallel - MAX_LARGE_PREFERRED)
        ok = [a for a in answered if isinstance(a, pb.PreferredAllocationResponse)]
        assert len(ok) == MAX_LARGE_PREFERRED
        assert all(len(a.container_responses) == 20 for a in ok)
        kept = [o for o in garbage if isinstance(o, pb.PreferredAllocationRequest)]
        assert kept == [], f"{len(kept)} requests were left to the cyclic collector"


async def refusals(calls: list[asyncio.Future[Any]], count: int) -> list[grpc.StatusCode]:
    """The status codes of the first ``count`` calls to fail (within WAIT_S)."""
    codes: list[grpc.StatusCode] = []
    pending = set(calls)
    async with asyncio.timeout(WAIT_S):
        while len(codes) < count:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            codes += [c.exception().code() for c in done if c.exception() is not None]  # type: ignore[union-attr]
    return codes


async def test_a_refused_allocate_leaves_nothing_to_the_cyclic_collector(
    short_dir: Path,
) -> None:
    """A refused Allocate's request (its bytes and the parsed message) is freed when the
    refusal is sent, not left in a cycle for the collector's next run."""
    bogus = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["ghost"])]
    )
    async with served(short_dir, DEVICES, None) as (_, stub):
        with cyclic_garbage() as garbage:
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Allocate(bogus)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    kept = [o for o in garbage if isinstance(o, pb.AllocateRequest)]
    assert kept == [], f"{len(kept)} requests were left to the cyclic collector"

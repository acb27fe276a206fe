"""GetPreferredAllocation's answers (devplug.kubelet.preferring): where the work runs is one
decision, by the ids of the whole request; hooks of either kind are kept within the offer."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import structlog

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.kubelet import preferring
from devplug.kubelet.allocation import default_preferred
from devplug.kubelet.preferring import PREFERRED_OFF_LOOP_IDS, PreferredAnswers
from devplug.model import DeviceInfo

RESOURCE = "example.com/dev"
DEVICES = {f"dev{i}": DeviceInfo() for i in range(PREFERRED_OFF_LOOP_IDS)}


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

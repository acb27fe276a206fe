"""The stop budget: one deadline from the first stop request, cut short by a second one, and
a run (then its worker threads) awaited within it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from devplug._kits.stopping import StopBudget, run_within_budget


async def test_the_budget_counts_from_the_first_request_and_a_second_one_ends_it() -> None:
    budget = StopBudget(30.0)
    assert not budget.begun and budget.remaining() == 30.0  # not counting yet
    assert budget.remaining(reserve_s=5.0) == 25.0
    assert budget.begin()
    assert 0 < budget.remaining() <= 30.0
    assert 0 < budget.remaining(reserve_s=5.0) <= 25.0
    assert budget.remaining(reserve_s=60.0) == 0.0  # never below zero
    spent = asyncio.create_task(budget.spent())
    await asyncio.sleep(0.01)
    assert not spent.done()
    assert not budget.begin()  # asked again: the budget ends now
    assert budget.cut_short and budget.remaining() == 0.0
    async with asyncio.timeout(5):
        await spent


async def test_spent_waits_for_the_stop_to_begin_then_for_the_deadline() -> None:
    budget = StopBudget(0.05)
    spent = asyncio.create_task(budget.spent())
    await asyncio.sleep(0.1)
    assert not spent.done()  # nothing counts before the stop begins
    budget.begin()
    async with asyncio.timeout(5):
        await spent


async def test_finish_returns_whether_the_work_ended_within_the_budget() -> None:
    budget = StopBudget(0.05)
    assert await budget.finish(asyncio.sleep(0))  # not begun: no bound
    budget.begin()
    never = asyncio.Event()
    work = asyncio.create_task(never.wait())
    assert not await budget.finish(work)
    assert not work.done()  # left running, for a caller that ends the process
    work.cancel()

    async def broken() -> None:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):  # what the work raises comes through
        await StopBudget(1.0).finish(broken())


def test_a_worker_thread_that_outlives_the_budget_is_reported_not_awaited() -> None:
    """What asyncio.run would wait for without end after the daemon stopped: a worker thread
    that never returns (a hung stop hook's). Here it is released once the outcome is known."""
    release = threading.Event()

    async def main() -> None:
        asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        budget.begin()  # a stop request

    budget = StopBudget(0.1)

    async def scenario() -> tuple[bool, bool, bool, object]:
        outcome = await run_within_budget(main(), budget)
        release.set()
        return outcome.stopped, outcome.threads_done, budget.cut_short, outcome.error

    assert asyncio.run(scenario()) == (True, False, False, None)


def test_a_run_that_raises_gives_its_threads_the_budget_and_passes_its_error_on() -> None:
    async def main() -> None:
        await asyncio.to_thread(lambda: None)
        raise RuntimeError("crashed")

    async def scenario() -> tuple[bool, bool, str]:
        budget = StopBudget(5.0)
        outcome = await run_within_budget(main(), budget)
        assert budget.begun  # a crash begins the stop, so its threads are bounded too
        return outcome.stopped, outcome.threads_done, repr(outcome.error)

    assert asyncio.run(scenario()) == (True, True, "RuntimeError('crashed')")


def test_a_run_still_stopping_when_the_budget_is_cut_short_is_overdue() -> None:
    async def main() -> None:
        asyncio.get_running_loop().call_soon(budget.begin)
        asyncio.get_running_loop().call_later(0.05, budget.begin)  # asked again
        await asyncio.Event().wait()  # a stop that never ends

    budget = StopBudget(3600.0)

    async def scenario() -> tuple[bool, bool, bool]:
        outcome = await run_within_budget(main(), budget)
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        return outcome.stopped, outcome.overdue, budget.cut_short

    assert asyncio.run(scenario()) == (False, True, True)

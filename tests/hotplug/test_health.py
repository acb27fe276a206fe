"""HealthGate: bad news published at once, recovery only after a full hold-down (fake clock)."""

from __future__ import annotations

import dataclasses

import pytest

from devplug.hotplug.health import HealthGate
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health

RESOURCE = "example.com/r"
HOLD_DOWN = 10.0


class FakeClock:
    """A clock that only moves when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def healthy(node: str = "/dev/r0") -> DeviceInfo:
    return DeviceInfo(nodes=(DeviceNode(node),), sources=("/sys/devices/r",))


def unhealthy(reason: str = "node missing", node: str = "/dev/r0") -> DeviceInfo:
    return DeviceInfo(
        health=Health.UNHEALTHY,
        health_reason=reason,
        nodes=(DeviceNode(node),),
        sources=("/sys/devices/r",),
    )


def tree(**devices: DeviceInfo) -> DeviceTree:
    return DeviceTree({RESOURCE: devices})


def published(gated: DeviceTree, device_id: str) -> DeviceInfo:
    return gated[RESOURCE][device_id]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def gate(clock: FakeClock) -> HealthGate:
    return HealthGate(HOLD_DOWN, clock=clock)


def test_new_devices_are_published_as_reported(gate: HealthGate) -> None:
    raw = tree(a=healthy(), b=unhealthy())
    assert gate.gate(raw) == raw
    assert gate.next_deadline() is None


def test_an_empty_tree_passes_through(gate: HealthGate) -> None:
    assert gate.gate(DeviceTree()) == DeviceTree()
    assert gate.next_deadline() is None


def test_turning_unhealthy_is_published_at_once(gate: HealthGate) -> None:
    gate.gate(tree(a=healthy()))
    raw = tree(a=unhealthy("device node /dev/r0 is missing"))
    out = gate.gate(raw)
    assert out == raw
    assert published(out, "a").health is Health.UNHEALTHY
    assert published(out, "a").health_reason == "device node /dev/r0 is missing"
    # Nothing is held while the scanner itself says unhealthy.
    assert gate.next_deadline() is None


def test_recovery_is_held_down_for_the_hold_down_time(gate: HealthGate, clock: FakeClock) -> None:
    gate.gate(tree(a=healthy()))
    clock.now += 1
    gate.gate(tree(a=unhealthy()))
    clock.now += 1
    recovered_at = clock.now
    raw = tree(a=healthy())

    held = gate.gate(raw)
    assert held != raw
    assert published(held, "a").health is Health.UNHEALTHY
    assert gate.next_deadline() == recovered_at + HOLD_DOWN

    clock.now = recovered_at + HOLD_DOWN - 0.5
    still = gate.gate(raw)
    assert published(still, "a").health is Health.UNHEALTHY
    # The deadline counts from the start of the healthy stretch, not from the last call.
    assert gate.next_deadline() == recovered_at + HOLD_DOWN

    clock.now = recovered_at + HOLD_DOWN
    released = gate.gate(raw)
    assert released == raw
    assert published(released, "a").health is Health.HEALTHY
    assert gate.next_deadline() is None
    # And it stays released.
    clock.now += 100
    assert gate.gate(raw) == raw


def test_a_held_device_says_why_and_keeps_everything_else(gate: HealthGate) -> None:
    gate.gate(tree(a=unhealthy("device node /dev/r0 is missing")))
    raw = tree(a=healthy())
    held = published(gate.gate(raw), "a")
    assert "device node /dev/r0 is missing" in held.health_reason
    assert "held down" in held.health_reason
    # Only health and reason differ from what the scanner reported.
    assert held == dataclasses.replace(
        raw[RESOURCE]["a"], health=Health.UNHEALTHY, health_reason=held.health_reason
    )


def test_a_held_device_without_a_reason_still_says_it_is_held(gate: HealthGate) -> None:
    gate.gate(tree(a=unhealthy("")))
    held = published(gate.gate(tree(a=healthy())), "a")
    assert held.health is Health.UNHEALTHY
    assert "held down" in held.health_reason


def test_the_reason_is_the_latest_cause(gate: HealthGate, clock: FakeClock) -> None:
    gate.gate(tree(a=unhealthy("first cause")))
    clock.now += 1
    gate.gate(tree(a=healthy()))
    clock.now += 1
    gate.gate(tree(a=unhealthy("second cause")))
    clock.now += 1
    held = published(gate.gate(tree(a=healthy())), "a")
    assert "second cause" in held.health_reason
    assert "first cause" not in held.health_reason


def test_flapping_is_never_published_healthy_before_a_full_hold_down(
    gate: HealthGate, clock: FakeClock
) -> None:
    raw_healthy, raw_unhealthy = tree(a=healthy()), tree(a=unhealthy())
    gate.gate(raw_healthy)
    for flap in range(50):
        clock.now += 0.5
        assert published(gate.gate(raw_unhealthy), "a").health is Health.UNHEALTHY
        assert gate.next_deadline() is None
        clock.now += 0.5
        recovered_at = clock.now
        stretch = 1.0 + flap % 9  # 1 to 9 s of health: always shorter than the hold-down
        for elapsed in (0.0, stretch / 2, stretch):
            clock.now = recovered_at + elapsed
            out = gate.gate(raw_healthy)
            assert published(out, "a").health is Health.UNHEALTHY, (flap, elapsed)
            assert "held down" in published(out, "a").health_reason
            assert gate.next_deadline() == recovered_at + HOLD_DOWN
    # Now healthy for good: held until a whole hold-down has passed since the last flap.
    clock.now += 0.5
    gate.gate(raw_unhealthy)
    clock.now += 1
    recovered_at = clock.now
    for elapsed in (0.0, 1.0, 5.0, 9.0, HOLD_DOWN - 0.01):
        clock.now = recovered_at + elapsed
        assert published(gate.gate(raw_healthy), "a").health is Health.UNHEALTHY, elapsed
    clock.now = recovered_at + HOLD_DOWN
    assert gate.gate(raw_healthy) == raw_healthy


def test_devices_are_held_independently(gate: HealthGate, clock: FakeClock) -> None:
    start = clock.now
    gate.gate(tree(a=unhealthy("a broke"), b=unhealthy("b broke")))
    clock.now = start + 1
    gate.gate(tree(a=healthy(), b=unhealthy("b broke")))
    assert gate.next_deadline() == start + 1 + HOLD_DOWN
    clock.now = start + 4
    out = gate.gate(tree(a=healthy(), b=healthy()))
    assert "a broke" in published(out, "a").health_reason
    assert "b broke" in published(out, "b").health_reason
    # The earliest held device sets the deadline.
    assert gate.next_deadline() == start + 1 + HOLD_DOWN

    clock.now = start + 1 + HOLD_DOWN
    out = gate.gate(tree(a=healthy(), b=healthy()))
    assert published(out, "a").health is Health.HEALTHY
    assert published(out, "a").health_reason == ""
    assert published(out, "b").health is Health.UNHEALTHY
    assert gate.next_deadline() == start + 4 + HOLD_DOWN

    # b relapses: its hold-down is cancelled; a is unaffected.
    clock.now = start + 12
    out = gate.gate(tree(a=healthy(), b=unhealthy("b broke again")))
    assert published(out, "a").health is Health.HEALTHY
    assert published(out, "b").health_reason == "b broke again"
    assert gate.next_deadline() is None

    clock.now = start + 13
    gate.gate(tree(a=healthy(), b=healthy()))
    assert gate.next_deadline() == start + 13 + HOLD_DOWN
    clock.now = start + 13 + HOLD_DOWN
    final = tree(a=healthy(), b=healthy())
    assert gate.gate(final) == final
    assert gate.next_deadline() is None


def test_same_device_id_in_two_resources_is_two_devices(gate: HealthGate, clock: FakeClock) -> None:
    other = "example.com/other"
    gate.gate(DeviceTree({RESOURCE: {"a": unhealthy()}, other: {"a": healthy()}}))
    clock.now += 1
    raw = DeviceTree({RESOURCE: {"a": healthy()}, other: {"a": healthy()}})
    out = gate.gate(raw)
    assert out[RESOURCE]["a"].health is Health.UNHEALTHY
    assert out[other]["a"] == raw[other]["a"]


def test_a_new_device_is_not_held(gate: HealthGate, clock: FakeClock) -> None:
    gate.gate(tree(a=unhealthy()))
    clock.now += 1
    raw = tree(a=unhealthy(), b=healthy())
    assert gate.gate(raw) == raw
    assert gate.next_deadline() is None


def test_a_removed_device_is_forgotten(gate: HealthGate, clock: FakeClock) -> None:
    gate.gate(tree(a=unhealthy(), b=healthy()))
    clock.now += 1
    gate.gate(tree(a=healthy(), b=healthy()))
    assert gate.next_deadline() is not None
    clock.now += 1
    gate.gate(tree(b=healthy()))
    assert gate.next_deadline() is None
    # Back, healthy: a new device, published as reported at once.
    clock.now += 1
    raw = tree(a=healthy(), b=healthy())
    assert gate.gate(raw) == raw
    assert gate.next_deadline() is None


def test_a_device_removed_while_unhealthy_comes_back_afresh(
    gate: HealthGate, clock: FakeClock
) -> None:
    gate.gate(tree(a=unhealthy("old cause")))
    clock.now += 1
    gate.gate(DeviceTree())
    clock.now += 1
    raw = tree(a=healthy())
    assert gate.gate(raw) == raw
    # And a later failure says only its own cause.
    clock.now += 1
    gate.gate(tree(a=unhealthy("new cause")))
    clock.now += 1
    held = published(gate.gate(tree(a=healthy())), "a")
    assert "new cause" in held.health_reason
    assert "old cause" not in held.health_reason


def test_a_zero_hold_down_publishes_recovery_at_once(clock: FakeClock) -> None:
    gate = HealthGate(0, clock=clock)
    gate.gate(tree(a=unhealthy()))
    raw = tree(a=healthy())
    assert gate.gate(raw) == raw
    assert gate.next_deadline() is None


def test_unchanged_trees_pass_through(gate: HealthGate, clock: FakeClock) -> None:
    raw = tree(a=healthy(), b=unhealthy())
    for _ in range(5):
        clock.now += 3
        assert gate.gate(raw) == raw
        assert gate.next_deadline() is None


def test_next_deadline_is_none_without_held_devices(gate: HealthGate) -> None:
    assert gate.next_deadline() is None
    gate.gate(tree(a=healthy()))
    assert gate.next_deadline() is None
    gate.gate(tree(a=unhealthy()))
    assert gate.next_deadline() is None


def assert_edits_lead_from(last: DeviceTree, out: DeviceTree) -> None:
    """Each of ``out``'s maps that is not ``last``'s very map knows its edit from it, and the
    edit is true: ``last``'s map with the removed ids taken out and the added ones put in
    is the new map, every id outside the edit being the very same object in both."""
    for resource, devices in out.items():
        before = last.get(resource)
        if before is None or before is devices:
            continue
        edit = out.edit_since(resource, before)
        assert edit is not None, f"{resource}: no edit from the map published last"
        rebuilt = {i: d for i, d in before.items() if i not in edit.removed}
        rebuilt.update((i, devices[i]) for i in edit.added)
        assert rebuilt == dict(devices)
        for device_id in devices.keys() - edit.added:
            assert devices[device_id] is before[device_id]


def test_gating_edits_matches_full_passes_through_random_walks() -> None:
    """Random walks of tree edits (health flips, re-reads giving equal devices, removals,
    additions, resources coming and going, hold-down deadlines, trees that know no edit):
    a gate given the edited trees, which looks at the edited and held-down devices only,
    publishes what a gate given the same trees without their edits (a full pass every time)
    publishes, and keeps the same memory; and what it publishes of an edited tree states its
    edit from what it published last, held-down devices or not, so that the ListAndWatch
    message and the metrics follow the edit instead of redoing every device."""
    import random

    names = ["example.com/a", "example.com/b"]
    reasons = ["", "node missing", "driver gone"]
    for seed in range(30):
        rng = random.Random(seed)
        clock = FakeClock()
        edited, full = HealthGate(HOLD_DOWN, clock=clock), HealthGate(HOLD_DOWN, clock=clock)

        def info(rng: random.Random = rng) -> DeviceInfo:
            return healthy() if rng.random() < 0.6 else unhealthy(rng.choice(reasons))

        raw = DeviceTree({names[0]: {str(i): info() for i in range(rng.randrange(1, 8))}})
        last_out = edited.gate(raw)
        full.gate(DeviceTree(raw))
        ever_held = bool(edited._healthy_since)
        for _ in range(120):
            removed = [(r, i) for r in raw for i in raw[r] if rng.random() < 0.2]
            added: dict[str, dict[str, DeviceInfo]] = {}
            for r, i in removed:
                if rng.random() < 0.8:  # re-read: the same object, an equal one or another
                    choice = rng.random()
                    old = raw[r][i]
                    new = (
                        old
                        if choice < 0.3
                        else dataclasses.replace(old)
                        if choice < 0.5
                        else info()
                    )
                    added.setdefault(r, {})[i] = new
            for _ in range(rng.choice([0, 0, 1, 2])):
                r, i = rng.choice(names), str(rng.randrange(12))
                if i not in raw.get(r, {}) or (r, i) in removed:
                    added.setdefault(r, {}).setdefault(i, info())
            step = rng.random()
            if step < 0.15:
                pass  # the same tree again: a hold-down deadline, say
            elif step < 0.2:
                raw = DeviceTree(raw)  # a tree that knows no edit (a full scan)
            else:
                raw = raw.with_changes(removed, added)
            clock.now += rng.choice([0, 0.5, 1, 3, HOLD_DOWN / 2, HOLD_DOWN])
            knew_edit = step >= 0.2
            # Once a device is held down, its resource is rebuilt from what was published
            # until a full scan (a tree that knows no edit) starts afresh.
            ever_held = ever_held and not 0.15 <= step < 0.2
            out = edited.gate(raw)
            assert out == full.gate(DeviceTree(raw))
            ever_held = ever_held or bool(edited._healthy_since)
            if not ever_held:
                assert out is raw
            if knew_edit:
                assert_edits_lead_from(last_out, out)
            last_out = out
            assert edited._published == full._published
            assert edited._healthy_since == full._healthy_since
            assert edited._last_reason == full._last_reason
            assert edited.next_deadline() == full.next_deadline()

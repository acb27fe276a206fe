"""Cordons: the health gate applies them (full and edited passes, lifted ones held down, every
device held while they cannot be read), and the book keeps them in its state file."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Collection
from pathlib import Path

import pytest

from devplug.hotplug.cordons import (
    Cordon,
    CordonBook,
    CordonsUnreadable,
    parse_state,
    state_bytes,
)
from devplug.hotplug.health import HealthGate
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health

RESOURCE = "example.com/r"
HOLD_DOWN = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Cordons:
    """The gate's view of cordons, set by the test."""

    def __init__(self) -> None:
        self.reasons: dict[tuple[str, str], str] = {}
        self.blanket: str | None = None

    def reason(self, resource: str, device_id: str) -> str | None:
        return self.reasons.get((resource, device_id))

    def keys(self) -> Collection[tuple[str, str]]:
        return self.reasons.keys()


def device(health: Health = Health.HEALTHY, reason: str = "") -> DeviceInfo:
    return DeviceInfo(health=health, health_reason=reason, nodes=(DeviceNode("/dev/null"),))


def tree(*ids: str) -> DeviceTree:
    return DeviceTree({RESOURCE: {i: device() for i in ids}})


def reasons(gated: DeviceTree) -> dict[str, str]:
    """Each device's health, with its reason when it is unhealthy."""
    return {
        i: info.health.value + (f" ({info.health_reason})" if info.health_reason else "")
        for i, info in gated[RESOURCE].items()
    }


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cordons() -> Cordons:
    return Cordons()


@pytest.fixture
def gate(clock: FakeClock, cordons: Cordons) -> HealthGate:
    return HealthGate(HOLD_DOWN, clock=clock, cordons=cordons)


def test_a_cordoned_device_is_unhealthy_at_once_with_the_reason_first(
    gate: HealthGate, cordons: Cordons
) -> None:
    raw = DeviceTree(
        {RESOURCE: {"a": device(), "b": device(), "c": device(Health.UNHEALTHY, "no node")}}
    )
    cordons.reasons = {(RESOURCE, "b"): "bad fan", (RESOURCE, "c"): "swap"}
    gated = gate.gate(raw)
    assert reasons(gated) == {
        "a": "Healthy",
        "b": "Unhealthy (cordoned: bad fan)",
        "c": "Unhealthy (cordoned: swap; no node)",  # the scanner's reason kept after it
    }
    assert gated[RESOURCE]["a"] is raw[RESOURCE]["a"]  # the others are the scanners' own


def test_a_lifted_cordon_is_held_down_like_a_recovery(
    gate: HealthGate, cordons: Cordons, clock: FakeClock
) -> None:
    raw = tree("a", "b")
    cordons.reasons = {(RESOURCE, "b"): "bad fan"}
    gate.gate(raw)
    cordons.reasons = {}
    held = "Unhealthy (uncordoned; held down until healthy for 10s)"
    assert reasons(gate.gate(raw)) == {"a": "Healthy", "b": held}
    assert gate.next_deadline() == clock.now + HOLD_DOWN
    clock.now += HOLD_DOWN / 2
    assert reasons(gate.gate(raw))["b"] == held
    clock.now += HOLD_DOWN / 2
    assert reasons(gate.gate(raw)) == {"a": "Healthy", "b": "Healthy"}
    assert gate.next_deadline() is None


def test_edited_trees_keep_cordons_and_hold_lifted_ones(gate: HealthGate, cordons: Cordons) -> None:
    """A hotplug event's tree is an edit of the last one: the gate looks only at the edited
    devices, the held-down ones and the cordoned ones (put or lifted since)."""
    first = tree("a", "b")
    gate.gate(first)
    cordons.reasons = {(RESOURCE, "b"): "bad fan"}
    second = first.with_changes([], {RESOURCE: {"c": device()}})  # c plugged in
    assert second.edit_since(RESOURCE, first[RESOURCE]) is not None  # an edit indeed
    assert reasons(gate.gate(second)) == {
        "a": "Healthy",
        "b": "Unhealthy (cordoned: bad fan)",
        "c": "Healthy",
    }
    cordons.reasons = {}
    third = second.with_changes([(RESOURCE, "c")], {})  # c unplugged
    assert reasons(gate.gate(third)) == {
        "a": "Healthy",
        "b": "Unhealthy (uncordoned; held down until healthy for 10s)",
    }


def test_a_cordoned_device_that_goes_comes_back_cordoned(
    gate: HealthGate, cordons: Cordons
) -> None:
    cordons.reasons = {(RESOURCE, "b"): "bad fan"}
    gate.gate(tree("a", "b"))
    assert reasons(gate.gate(tree("a"))) == {"a": "Healthy"}
    assert reasons(gate.gate(tree("a", "b")))["b"] == "Unhealthy (cordoned: bad fan)"


def test_while_the_cordons_are_unknown_every_device_is_held(
    gate: HealthGate, cordons: Cordons, clock: FakeClock
) -> None:
    raw = tree("a", "b")
    gate.gate(raw)
    cordons.blanket = "cordons unknown: x"
    assert reasons(gate.gate(raw)) == {
        "a": "Unhealthy (cordons unknown: x)",
        "b": "Unhealthy (cordons unknown: x)",
    }
    cordons.blanket = None
    assert set(reasons(gate.gate(raw)).values()) == {
        "Unhealthy (cordons unknown: x; recovered, held down until healthy for 10s)"
    }
    clock.now += HOLD_DOWN
    assert set(reasons(gate.gate(raw)).values()) == {"Healthy"}


# ---------------------------------------------------------------------- the book and its file


def book_in(tmp_path: Path) -> CordonBook:
    return CordonBook(tmp_path / "devplug.cordons.json", clock=lambda: "2025-01-31T09:30:00Z")


async def test_cordons_are_written_before_they_take_effect_and_read_back(
    tmp_path: Path,
) -> None:
    book = book_in(tmp_path)
    await book.load()
    assert await book.cordon(RESOURCE, "b", "bad fan") == Cordon("bad fan", "2025-01-31T09:30:00Z")
    assert await book.cordon(RESOURCE, "b", "bad fan") is None  # as it was
    assert json.loads(book.path.read_text()) == {
        "version": 1,
        "cordons": {RESOURCE: {"b": {"reason": "bad fan", "since": "2025-01-31T09:30:00Z"}}},
    }
    assert stat.S_IMODE(book.path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [book.path.name]  # no temp file left

    again = book_in(tmp_path)
    await again.load()
    assert again.items() == [((RESOURCE, "b"), Cordon("bad fan", "2025-01-31T09:30:00Z"))]
    assert await again.uncordon(RESOURCE, "b") == Cordon("bad fan", "2025-01-31T09:30:00Z")
    assert await again.uncordon(RESOURCE, "b") is None
    assert json.loads(book.path.read_text())["cordons"] == {}


async def test_a_write_that_fails_changes_nothing(tmp_path: Path) -> None:
    book = CordonBook(tmp_path / "gone" / "devplug.cordons.json")  # its dir is missing
    await book.load()
    with pytest.raises(FileNotFoundError):
        await book.cordon(RESOURCE, "b", "bad fan")
    assert book.items() == [] and book.reason(RESOURCE, "b") is None


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"version": 2, "cordons": {}}', "version: 2, this devplug reads version 1"),
        (b'{"version": 1, "cordons": {}, "extra": 1}', "unknown fields ['extra']"),
        (b'{"version": 1, "cordons": {"r": []}}', "cordons.r: expected an object"),
        (
            b'{"version": 1, "cordons": {"example.com/r": {"b": {"reason": "x"}}}}',
            "cordons.example.com/r.b: expected the fields 'reason' and 'since'",
        ),
        (
            b'{"version": 1, "cordons": {"example.com/r": {"b": {"reason": "a\\nb", '
            b'"since": "2025-01-31T09:30:00Z"}}}}',
            "cordons.example.com/r.b.reason: printable",
        ),
        (
            b'{"version": 1, "cordons": {"example.com/r": {"b": {"reason": "x", '
            b'"since": "yesterday"}}}}',
            "cordons.example.com/r.b.since: 'yesterday' is not an ISO 8601 time",
        ),
        (
            b'{"version": 1, "cordons": {"example.com/r": {"../b": {"reason": "x", '
            b'"since": "2025-01-31T09:30:00Z"}}}}',
            "cordons.example.com/r.../b: device id '../b'",
        ),
    ],
)
def test_a_file_that_is_wrong_is_refused_naming_the_field(content: bytes, expected: str) -> None:
    with pytest.raises(ValueError, match="^" + expected.replace("[", r"\[").replace("(", r"\(")):
        parse_state(content)


async def test_an_unreadable_file_holds_everything_and_is_never_overwritten(
    tmp_path: Path,
) -> None:
    book = book_in(tmp_path)
    book.path.write_bytes(b'{"version": 7}')
    await book.load()
    assert book.blanket is not None and str(book.path) in book.blanket
    assert "version: 7" in book.blanket
    with pytest.raises(CordonsUnreadable):
        await book.cordon(RESOURCE, "b", "bad fan")
    with pytest.raises(CordonsUnreadable):
        await book.uncordon(RESOURCE, "b")
    assert book.path.read_bytes() == b'{"version": 7}'

    book.path.write_bytes(state_bytes({(RESOURCE, "b"): Cordon("bad fan", "2025-01-31T09:30:00Z")}))
    await book.reread()
    assert book.blanket is None and book.reason(RESOURCE, "b") == "bad fan"


async def test_a_reload_keeps_the_running_cordons_and_a_lost_file_is_written_again(
    tmp_path: Path,
) -> None:
    book = book_in(tmp_path)
    await book.load()
    await book.cordon(RESOURCE, "b", "bad fan")
    book.path.unlink()  # the dir wiped
    await book.reread()
    assert book.reason(RESOURCE, "b") == "bad fan"
    await book.restore_file()
    assert json.loads(book.path.read_text())["cordons"][RESOURCE]["b"]["reason"] == "bad fan"


async def test_a_cancelled_change_still_follows_the_file(tmp_path: Path) -> None:
    """The command that asked may go; the write goes on, and the set follows what was written."""
    book = book_in(tmp_path)
    await book.load()
    task = asyncio.create_task(book.cordon(RESOURCE, "b", "bad fan"))
    await asyncio.sleep(0)  # the write has started in its thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    written = parse_state(book.path.read_bytes())
    assert (
        dict(book.items())
        == written
        == {(RESOURCE, "b"): Cordon("bad fan", "2025-01-31T09:30:00Z")}
    )

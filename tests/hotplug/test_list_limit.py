"""Every resource's ListAndWatch message stays within the kubelet's receive limit, whatever the
scanner: devices already advertised keep their place, newcomers wait in id order.

The unit tests use a small limit; the daemon tests use the real 4 MiB one against the kubelet
simulator, whose channel reads with gRPC's default receive limit, as the kubelet's does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from devplug.cli.report import render
from devplug.hotplug.list_limit import ListLimit
from devplug.hotplug.scanning import HELD_BACK_SECTION, ScanRunner
from devplug.kubelet.wire import list_message
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, device_entry_bytes
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner
from devplug.testing.simulator import SimulatorRpcError

SERIAL = "example.com/serial"
OTHER = "example.com/other"
INFO = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
# One "devNN" device counted at its longest (Unhealthy): 2 + (2 + 5) + (2 + 9) = 20 bytes.
ENTRY = device_entry_bytes("dev10", "Unhealthy")


def serials(*numbers: int, info: DeviceInfo = INFO) -> dict[str, DeviceInfo]:
    return {f"dev{n}": info for n in numbers}


def tree(**resources: dict[str, DeviceInfo]) -> DeviceTree:
    names = {"serial": SERIAL, "other": OTHER}
    return DeviceTree({names[key]: devices for key, devices in resources.items()})


def held_events(logs: list[structlog.typing.EventDict]) -> list[structlog.typing.EventDict]:
    return [e for e in logs if e["event"] == "list_limit.devices_held_back"]


def test_a_tree_that_fits_is_returned_as_it_is() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    given = tree(serial=serials(*range(10, 20)), other=serials(*range(10, 15)))
    fitted, held = limit.fit(given)
    assert fitted is given
    assert held == {}


def test_newcomers_wait_in_id_order_and_only_the_resource_over_the_limit_is_cut() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    other = serials(*range(10, 15))
    with structlog.testing.capture_logs() as logs:
        fitted, held = limit.fit(tree(serial=serials(*range(10, 25)), other=other))
    assert sorted(fitted[SERIAL]) == [f"dev{n}" for n in range(10, 20)]
    assert held == {SERIAL: tuple(f"dev{n}" for n in range(20, 25))}
    assert fitted[OTHER] is not None and dict(fitted[OTHER]) == other
    (event,) = held_events(logs)
    assert event["resource"] == SERIAL
    assert event["count"] == 5
    assert event["bytes"] == 15 * ENTRY
    assert event["limit"] == 10 * ENTRY
    assert "fewer ids" in event["fix"]


def test_what_was_advertised_keeps_its_place_when_lower_ids_arrive() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    limit.fit(tree(serial=serials(*range(20, 30))))  # full: exactly ten
    fitted, held = limit.fit(tree(serial=serials(*range(10, 30))))
    assert sorted(fitted[SERIAL]) == [f"dev{n}" for n in range(20, 30)]
    assert held == {SERIAL: tuple(f"dev{n}" for n in range(10, 20))}


def test_a_removal_makes_room_for_the_first_waiting_newcomer() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    limit.fit(tree(serial=serials(*range(10, 22))))
    # dev11 goes: dev20, the first waiting, takes its place; dev21 still waits.
    fitted, held = limit.fit(tree(serial=serials(10, *range(12, 22))))
    assert sorted(fitted[SERIAL]) == sorted(["dev10", *(f"dev{n}" for n in range(12, 21))])
    assert held == {SERIAL: ("dev21",)}


def test_health_flips_never_change_the_verdict() -> None:
    """Sizes are counted at "Unhealthy", so a list that fits keeps fitting whatever the health
    gate does after the check."""
    limit = ListLimit(limit=10 * ENTRY)
    healthy, _ = limit.fit(tree(serial=serials(*range(10, 20))))
    sick = DeviceInfo(health=Health.UNHEALTHY, nodes=INFO.nodes)
    unhealthy, held = limit.fit(tree(serial=serials(*range(10, 20), info=sick)))
    assert held == {}
    assert set(unhealthy[SERIAL]) == set(healthy[SERIAL])
    assert len(list_message(unhealthy[SERIAL]).SerializeToString()) <= limit.limit


def test_the_held_back_error_is_logged_once_per_change_and_recovery_is_logged() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    over = tree(serial=serials(*range(10, 25)))
    with structlog.testing.capture_logs() as logs:
        limit.fit(over)
        limit.fit(tree(serial=serials(*range(10, 25))))  # a new map, the same verdict
        limit.fit(tree(serial=serials(*range(10, 26))))  # one more waits
        limit.fit(tree(serial=serials(*range(10, 15))))  # room for all
    assert [e["count"] for e in held_events(logs)] == [5, 6]
    assert [e["event"] for e in logs if e["event"] == "list_limit.all_advertised"] == [
        "list_limit.all_advertised"
    ]


def test_a_list_near_the_limit_is_warned_about_once() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    with structlog.testing.capture_logs() as logs:
        limit.fit(tree(serial=serials(*range(10, 19))))  # 90 %
        limit.fit(tree(serial=serials(*range(10, 18))))  # 80 %: still near
        limit.fit(tree(serial=serials(*range(10, 13))))  # far below: the warning re-arms
        limit.fit(tree(serial=serials(*range(10, 19))))
    assert [e["event"] for e in logs if e["event"] == "list_limit.near"] == ["list_limit.near"] * 2


@pytest.mark.parametrize("numa_nodes", [(), (0,), (1,), (3, 7), (2**40,)])
def test_the_trimmed_list_fits_the_real_encoder(numa_nodes: tuple[int, ...]) -> None:
    """Whatever the ids and topology, the encoded message of what is advertised, every device
    Unhealthy, is within the limit; one more device would not be."""
    limit = ListLimit(limit=4096)
    info = DeviceInfo(health=Health.UNHEALTHY, nodes=INFO.nodes, numa_nodes=numa_nodes)
    devices = {f"device-{n:04d}{'x' * (n % 50)}": info for n in range(400)}
    fitted, held = limit.fit(DeviceTree({SERIAL: devices}))
    assert held
    advertised = fitted[SERIAL]
    assert len(list_message(advertised).SerializeToString()) <= limit.limit
    one_more = {**advertised, held[SERIAL][0]: info}
    assert len(list_message(one_more).SerializeToString()) > limit.limit


def test_devplug_scan_shows_what_was_held_back() -> None:
    ids = {f"{'d' * 54}-{n:06d}": INFO for n in range(60_000)}  # ~4.7 MB of list
    result = ScanRunner([StaticScanner({SERIAL: ids})]).scan_blocking()
    held = result.held_back[SERIAL]
    assert held and len(result.tree[SERIAL]) + len(held) == len(ids)
    sections = result.extras[HELD_BACK_SECTION]
    assert isinstance(sections, list) and len(sections) == 1
    section = sections[0]
    assert section["id"] == SERIAL and section["ids"] == list(held)
    table = render(result.tree, "table", result.extras)
    assert f"{HELD_BACK_SECTION}: {SERIAL}: {len(held):,} devices: over the kubelet's" in table


class ReportingScanner(StaticScanner):
    """A scanner whose report claims the section the list limit reports in."""

    def report(self) -> dict[str, object]:
        return {HELD_BACK_SECTION: [{"id": "mine", "reason": "a scanner's own"}]}


def test_a_scanner_cannot_take_the_held_back_section() -> None:
    ids = {f"{'d' * 54}-{n:06d}": INFO for n in range(60_000)}
    with structlog.testing.capture_logs() as logs:
        result = ScanRunner([ReportingScanner({SERIAL: ids})]).scan_blocking()
    sections = result.extras[HELD_BACK_SECTION]
    assert isinstance(sections, list) and [s["id"] for s in sections] == [SERIAL]
    clash = [e for e in logs if e["event"] == "scan.report.clash"]
    assert [e["section"] for e in clash] == [HELD_BACK_SECTION]


def test_an_unchanged_resource_is_not_counted_again_between_scans() -> None:
    """Scans share an unchanged resource's map (DeviceTree.merged copies nothing), so the
    limit reuses its verdict and its trimmed map: the same objects come out."""
    over = StaticScanner({SERIAL: {f"{'d' * 54}-{n:06d}": INFO for n in range(60_000)}})
    small = StaticScanner({OTHER: serials(1, 2)})
    runner = ScanRunner([over, small])
    first = runner.scan_blocking()
    small.set({OTHER: serials(1, 2, 3)})  # another resource changes
    with structlog.testing.capture_logs() as logs:
        second = runner.scan_blocking()
    assert second.tree[SERIAL] is first.tree[SERIAL]
    assert second.held_back[SERIAL] is first.held_back[SERIAL]
    assert set(second.tree[OTHER]) == {"dev1", "dev2", "dev3"}
    assert held_events(logs) == []


async def test_a_resource_past_4_mib_is_served_trimmed_and_the_rest_refused(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """Without the limit the simulator (like the kubelet) could not read the list at all and
    the resource's capacity would be zero."""
    ids = {f"{'d' * 54}-{n:06d}": INFO for n in range(60_000)}
    full = list_message(ids).ByteSize()
    assert full > KUBELET_MAX_RECEIVE_BYTES
    async with running_daemon(
        daemon_settings(kubelet_dir), [StaticScanner({SERIAL: ids})]
    ) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        listed = await session.wait_for_update(timeout=60)
        assert not session.stream_ended.is_set()
        assert 50_000 < len(listed) < len(ids)
        first, last = min(listed), max(listed)
        waiting = sorted(set(ids) - set(listed))
        assert max(listed) < min(waiting)  # newcomers wait in id order: the last ones
        (answer,) = await session.allocate([first, last])
        assert [node.host_path for node in answer.nodes] == ["/dev/null"]
        with pytest.raises(SimulatorRpcError) as refused:
            await session.allocate([waiting[0]])
        assert refused.value.code == "NOT_FOUND"
        held_metric = daemon.metrics.registry.get_sample_value(
            "devplug_devices_held_back", {"resource": SERIAL}
        )
        assert held_metric == len(waiting)

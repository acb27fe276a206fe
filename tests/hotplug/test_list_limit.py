"""Every resource's ListAndWatch message stays within the kubelet's receive limit, whatever the
scanner: units (the ids that share one DeviceInfo object, such as a GPU's shares) are advertised
whole or not at all; those already advertised keep their place, newcomers wait in the natural
order of their first id.

The unit tests use a small limit; the daemon tests use the real 4 MiB one against the kubelet
simulator, whose channel reads with gRPC's default receive limit, as the kubelet's does.
Intel GPUs through the same limit: tests/scanners/test_intel_gpu_list_limit.py.
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
from devplug.naming import natural_key
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, counted_entry_bytes, device_entry_bytes
from devplug.testing import KubeletSimulator, StaticScanner, daemon_settings, running_daemon
from devplug.testing.simulator import SimulatorRpcError

SERIAL = "example.com/serial"
OTHER = "example.com/other"
NODES = (DeviceNode("/dev/null"),)
# One "devNN" device counted at its longest (Unhealthy): 2 + (2 + 5) + (2 + 9) = 20 bytes.
ENTRY = device_entry_bytes("dev10", "Unhealthy")


def serials(*numbers: int, health: Health = Health.HEALTHY) -> dict[str, DeviceInfo]:
    """One device per number, each with a DeviceInfo of its own (equal ones, distinct objects:
    each device is a unit of its own)."""
    return {f"dev{n}": DeviceInfo(health=health, nodes=NODES) for n in numbers}


def shared(*gpus: int, shares: int = 3) -> dict[str, DeviceInfo]:
    """``gpN-0`` .. ``gpN-<shares-1>`` per GPU, sharing one DeviceInfo: one unit per GPU. For
    a one-digit N the ids are as long as "devNN", so each costs ENTRY too."""
    devices: dict[str, DeviceInfo] = {}
    for gpu in gpus:
        info = DeviceInfo(nodes=NODES)
        devices.update({f"gp{gpu}-{share}": info for share in range(shares)})
    return devices


def many(count: int) -> dict[str, DeviceInfo]:
    """``count`` devices with 61-character ids: 60,000 of them make a ~4.7 MB list."""
    return {f"{'d' * 54}-{n:06d}": DeviceInfo(nodes=NODES) for n in range(count)}


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


# ------------------------------------------------------------------------------- units


def test_ids_that_share_a_device_info_wait_together() -> None:
    """Room for ten ids, four GPUs of three shares: three GPUs fit, the fourth waits whole
    (one id at a time, a tenth id, its first share, would have fitted)."""
    limit = ListLimit(limit=10 * ENTRY)
    devices = shared(1, 2, 3, 4)
    with structlog.testing.capture_logs() as logs:
        fitted, held = limit.fit(tree(serial=devices))
    assert sorted(fitted[SERIAL]) == sorted(i for i in devices if not i.startswith("gp4-"))
    assert held == {SERIAL: ("gp4-0", "gp4-1", "gp4-2")}
    (event,) = held_events(logs)
    assert event["count"] == 3 and event["units"] == 1
    assert event["held_back"] == ["gp4-0"]  # a unit is named by its first id
    assert "3 wait, in 1 whole units" in event["reason"]


def test_equal_infos_that_are_distinct_objects_are_distinct_units() -> None:
    devices = serials(*range(10, 21))
    assert len(set(map(id, devices.values()))) == 11  # equal values, distinct objects
    first = devices["dev10"]
    assert all(info == first for info in devices.values())
    fitted, held = ListLimit(limit=10 * ENTRY).fit(tree(serial=devices))
    assert len(fitted[SERIAL]) == 10 and held == {SERIAL: ("dev20",)}


def test_units_wait_in_the_natural_order_of_their_first_id() -> None:
    """Whatever the order of the map and of the ids inside a unit: gp9 comes before gp10 (the
    natural order), and a unit's place is that of its naturally first id."""
    limit = ListLimit(limit=9 * ENTRY)
    late, early = DeviceInfo(nodes=NODES), DeviceInfo(nodes=NODES)
    devices = {
        **shared(11, 10),
        "gp9-2": early,
        "gp9-0": early,
        "gp9-1": early,
        **shared(12),
        "gp8-1": late,  # gp8 comes first: its first id is gp8-0, though inserted last
        "gp8-0": late,
    }
    fitted, held = limit.fit(tree(serial=devices))
    # gp8 (2), gp9 (3), gp10 (3) fit in nine; gp11 and gp12 wait, in that order.
    assert held == {SERIAL: ("gp11-0", "gp11-1", "gp11-2", "gp12-0", "gp12-1", "gp12-2")}
    assert sorted(fitted[SERIAL], key=natural_key) == sorted(
        [*shared(10), "gp8-0", "gp8-1", "gp9-0", "gp9-1", "gp9-2"], key=natural_key
    )
    assert list(fitted[SERIAL])[:2] == ["gp10-0", "gp10-1"]  # the scanner's order is kept


def test_an_advertised_unit_keeps_its_place_when_lower_units_arrive() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    limit.fit(tree(serial=shared(5, 6, 7)))  # nine ids: all advertised
    # New GPU objects for the same ids (a rescan made new infos), and two lower GPUs.
    fitted, held = limit.fit(tree(serial=shared(1, 2, 5, 6, 7)))
    assert sorted(fitted[SERIAL]) == sorted(shared(5, 6, 7))
    assert held == {SERIAL: tuple(shared(1, 2))}


def test_a_unit_that_does_not_fit_holds_back_the_ones_after_it() -> None:
    """No unit overtakes one that waits longer, even one small enough for the room left."""
    limit = ListLimit(limit=10 * ENTRY)
    # Two GPUs of four shares, and one device whose id sorts after every GPU's.
    devices = {**shared(1, 2, shares=4), "zz-30": DeviceInfo(nodes=NODES)}
    limit.fit(tree(serial=devices))  # nine ids: all advertised
    fitted, held = limit.fit(tree(serial={**devices, **shared(3)}))
    assert held == {SERIAL: ("gp3-0", "gp3-1", "gp3-2")}
    assert "zz-30" in fitted[SERIAL]  # advertised before gp3 came: it keeps its place
    fresh, waiting = ListLimit(limit=10 * ENTRY).fit(tree(serial={**devices, **shared(3)}))
    # Fresh: gp1, gp2 (8 ids) fit; gp3 (3) does not, and zz-30 (1) waits behind it.
    assert waiting == {SERIAL: ("gp3-0", "gp3-1", "gp3-2", "zz-30")}
    assert len(fresh[SERIAL]) == 8


def test_advertised_units_that_grew_past_the_limit_are_kept_in_order() -> None:
    """More shares per GPU (a reload): the advertised GPUs alone no longer fit, so they too are
    taken in order, and a newcomer waits behind them whatever its id."""
    limit = ListLimit(limit=10 * ENTRY)
    limit.fit(tree(serial=shared(3, 2, 1)))  # nine ids
    fitted, held = limit.fit(tree(serial={**shared(3, 2, 1, shares=4), **shared(0)}))
    assert {i.split("-")[0] for i in fitted[SERIAL]} == {"gp1", "gp2"}
    assert held == {SERIAL: (*shared(3, shares=4), *shared(0))}


def test_a_removed_unit_makes_room_for_the_first_waiting_one() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    limit.fit(tree(serial=shared(1, 2, 3, 4, 5)))
    fitted, held = limit.fit(tree(serial=shared(1, 3, 4, 5)))  # gp2 goes: gp4 takes its place
    assert {i.split("-")[0] for i in fitted[SERIAL]} == {"gp1", "gp3", "gp4"}
    assert held == {SERIAL: tuple(shared(5))}


def test_health_flips_never_change_the_verdict() -> None:
    """Sizes are counted at "Unhealthy", so a list that fits keeps fitting whatever the health
    gate does after the check."""
    limit = ListLimit(limit=10 * ENTRY)
    healthy, _ = limit.fit(tree(serial=serials(*range(10, 20))))
    unhealthy, held = limit.fit(tree(serial=serials(*range(10, 20), health=Health.UNHEALTHY)))
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
    said = [e for e in logs if e["log_level"] != "debug"]
    near = [e for e in said if e["event"] == "list_limit.near"]
    assert len(near) == 2 and len(said) == 2
    assert near[0]["log_level"] == "warning" and near[0]["resource"] == SERIAL
    assert near[0]["bytes"] == 9 * ENTRY and near[0]["limit"] == 10 * ENTRY
    assert "advertise fewer ids" in near[0]["hint"]


def test_a_list_that_stays_near_the_limit_is_not_warned_about_again() -> None:
    """Scan after scan near the limit, with a size that changes: one warning, the repeats at
    debug, so a busy host's log does not fill with it."""
    limit = ListLimit(limit=10 * ENTRY)
    with structlog.testing.capture_logs() as logs:
        for last in (19, 18, 20, 19, 18, 20):  # 90 %, 80 %, 100 %, ...
            limit.fit(tree(serial=serials(*range(10, last))))
    near = [e for e in logs if e["event"] == "list_limit.near"]
    assert [e["log_level"] for e in near] == ["warning"] + ["debug"] * 5
    assert [e["bytes"] for e in near] == [9 * ENTRY, 8 * ENTRY, 10 * ENTRY] * 2


def test_a_resource_that_goes_away_is_warned_about_again_when_it_comes_back() -> None:
    limit = ListLimit(limit=10 * ENTRY)
    with structlog.testing.capture_logs() as logs:
        limit.fit(tree(serial=serials(*range(10, 19))))
        limit.fit(DeviceTree({}))
        limit.fit(tree(serial=serials(*range(10, 19))))
    near = [e for e in logs if e["event"] == "list_limit.near" and e["log_level"] == "warning"]
    assert len(near) == 2


def test_a_list_below_80_percent_is_quiet() -> None:
    """Quiet whether the upper bound decides it (far below) or the exact count (just below)."""
    limit = ListLimit(limit=10 * ENTRY)
    with structlog.testing.capture_logs() as logs:
        limit.fit(tree(serial=serials(*range(10, 13))))
        limit.fit(tree(serial=serials(*range(10, 17))))  # 70 %: over the bound's 80 %
        limit.fit(tree(serial=shared(1, 2)))  # units make no difference below the limit
    assert logs == []


@pytest.mark.parametrize("numa_nodes", [(), (0,), (1,), (3, 7), (2**40,)])
def test_the_trimmed_list_fits_the_real_encoder(numa_nodes: tuple[int, ...]) -> None:
    """Whatever the ids and topology, the encoded message of what is advertised, every device
    Unhealthy, is within the limit; one more device would not be."""
    limit = ListLimit(limit=4096)
    devices = {
        f"device-{n:04d}{'x' * (n % 50)}": DeviceInfo(
            health=Health.UNHEALTHY, nodes=NODES, numa_nodes=numa_nodes
        )
        for n in range(400)
    }
    fitted, held = limit.fit(DeviceTree({SERIAL: devices}))
    assert held
    advertised = fitted[SERIAL]
    assert len(list_message(advertised).SerializeToString()) <= limit.limit
    one_more = {**advertised, held[SERIAL][0]: devices[held[SERIAL][0]]}
    assert len(list_message(one_more).SerializeToString()) > limit.limit


def test_devplug_scan_shows_what_was_held_back() -> None:
    ids = many(60_000)
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
    ids = many(60_000)
    with structlog.testing.capture_logs() as logs:
        result = ScanRunner([ReportingScanner({SERIAL: ids})]).scan_blocking()
    sections = result.extras[HELD_BACK_SECTION]
    assert isinstance(sections, list) and [s["id"] for s in sections] == [SERIAL]
    clash = [e for e in logs if e["event"] == "scan.report.clash"]
    assert [e["section"] for e in clash] == [HELD_BACK_SECTION]


def test_an_unchanged_resource_is_not_counted_again_between_scans() -> None:
    """Scans share an unchanged resource's map (DeviceTree.merged copies nothing), so the
    limit reuses its verdict and its trimmed map: the same objects come out."""
    over = StaticScanner({SERIAL: many(60_000)})
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
    ids = many(60_000)
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
        held_metric = daemon.metric("devplug_devices_held_back", resource=SERIAL)
        assert held_metric == len(waiting)


async def test_gpu_shares_past_4_mib_are_held_back_by_whole_gpus(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """Twenty GPUs of 2,801 shares each (one DeviceInfo per GPU, as the Intel and generic
    scanners build them) make a ~4.6 MB list. The kubelet gets whole GPUs only: one id at a
    time, the cut would fall inside a GPU and leave it advertised with part of its shares.
    (Long ids keep the count, and the test's time, down.)"""
    shares = 2_801
    gpus = [f"{'g' * 50}-{n:02d}" for n in range(20)]
    devices: dict[str, DeviceInfo] = {}
    for gpu in gpus:
        info = DeviceInfo(nodes=NODES, numa_nodes=(0,))
        devices.update({f"{gpu}-{share}": info for share in range(shares)})
    sizes = [counted_entry_bytes(i, (0,)) for i in sorted(devices, key=natural_key)]
    assert sum(sizes) > KUBELET_MAX_RECEIVE_BYTES
    room, by_id = KUBELET_MAX_RECEIVE_BYTES, 0
    while room >= sizes[by_id]:
        room, by_id = room - sizes[by_id], by_id + 1
    assert by_id % shares != 0  # the test's point: id by id, a GPU would be cut in two
    async with running_daemon(
        daemon_settings(kubelet_dir), [StaticScanner({SERIAL: devices})]
    ) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        listed = await session.wait_for_update(timeout=60)
        assert not session.stream_ended.is_set()
        shares_listed: dict[str, int] = {}
        for device_id in listed:
            gpu = device_id.rsplit("-", 1)[0]
            shares_listed[gpu] = shares_listed.get(gpu, 0) + 1
        assert set(shares_listed.values()) == {shares}  # no GPU with only some of its shares
        whole = by_id // shares
        assert sorted(shares_listed, key=natural_key) == gpus[:whole]  # the first GPUs, whole
        (answer,) = await session.allocate([f"{gpus[0]}-0", f"{gpus[whole - 1]}-{shares - 1}"])
        assert [node.host_path for node in answer.nodes] == ["/dev/null"]
        with pytest.raises(SimulatorRpcError) as refused:
            await session.allocate([f"{gpus[whole]}-0"])  # the first share of the first waiting
        assert refused.value.code == "NOT_FOUND"
        held_metric = daemon.metric("devplug_devices_held_back", resource=SERIAL)
        assert held_metric == (len(gpus) - whole) * shares


def test_counting_numa_nodes_from_edits_matches_a_full_count_through_random_walks() -> None:
    """A random walk of tree edits (devices with and without NUMA nodes, re-reads, removals,
    additions; lists below, near and over the limit): a limit given the edited trees, which
    counts NUMA nodes from the edit, answers what a limit given the same trees without their
    edits answers, and its count is the full count."""
    import random

    rng = random.Random(16)
    edited, full = ListLimit(limit=560), ListLimit(limit=560)

    def info() -> DeviceInfo:
        return DeviceInfo(nodes=NODES, numa_nodes=rng.choice([(), (0,), (1,), (0, 1, 2)]))

    tree = DeviceTree({SERIAL: {"dev0": info()}})
    for _ in range(400):
        devices = tree.get(SERIAL, {})
        removed = [(SERIAL, i) for i in devices if rng.random() < 0.1]
        added: dict[str, dict[str, DeviceInfo]] = {SERIAL: {}}
        for _, i in removed:
            if rng.random() < 0.5:
                added[SERIAL][i] = devices[i] if rng.random() < 0.3 else info()
        for _ in range(rng.choice([0, 1, 2, 3])):
            i = f"dev{rng.randrange(60)}"
            if i not in devices or (SERIAL, i) in removed:
                added[SERIAL].setdefault(i, info())
        tree = tree.with_changes(removed, added)
        if rng.random() < 0.05:
            tree = DeviceTree(tree)  # a tree that knows no edit
        assert edited.fit(tree) == full.fit(DeviceTree(tree))
        if SERIAL in tree:
            count = sum(len(d.numa_nodes) for d in tree[SERIAL].values())
            assert edited._last[SERIAL].numa_nodes == count

"""The generic scanner's incremental path: rescan from events == a full scan of the same host.

A generic device whose node vanishes is Unhealthy only if the scanner advertised it before, so
each test runs two scanners with the same history: one only rescans from events, the other
only scans fully, and their trees must stay equal.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence

import pytest

from devplug.model import DeviceTree, Health
from devplug.scanners.generic import GenericScanner
from devplug.scanners.incremental import SourceIndex, TouchedPaths
from devplug.scanners.udev import UdevEvent, UdevMonitor, UdevSource
from devplug.testing.umockdev import (
    MockNode,
    UmockdevHost,
    add_intel_gpu,
    add_pci_device,
    add_usb_serial,
)

SERIAL = "example.com/serial"
RENDER = "example.com/render"
CARD = "example.com/card"
SERIAL_ENTRY: dict[str, object] = {
    "resource": SERIAL,
    "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*"},
}
RENDER_ENTRY: dict[str, object] = {
    "resource": RENDER,
    "match": {"subsystem": "drm", "devnode": "/dev/dri/renderD*"},
}
USB_CONTROLLER = "/sys/devices/pci0000:00/0000:00:14.0"


def usb_device(index: int) -> str:
    """The USB device of ``add_usb_serial(index=index)`` (what unplugging removes)."""
    return f"{USB_CONTROLLER}/usb1/1-{index + 1}"


def gpu_address(slot: int) -> str:
    return f"0000:{slot + 1:02x}:00.0"


def events(action: str, paths: Iterable[str]) -> list[UdevEvent]:
    """Events for ``paths``; a remove carries no subsystem (the scanner must not need it)."""
    result = []
    for path in paths:
        device = UdevSource().device(path) if action != "remove" else None
        result.append(UdevEvent(action, path, None if device is None else device.subsystem))
    return result


class Pair:
    """Two scanners of one config with the same history: incremental and full."""

    def __init__(self, *entries: Mapping[str, object]) -> None:
        self.incremental = GenericScanner.from_config(list(entries))
        self.full = GenericScanner.from_config(list(entries))
        self.tree = self.incremental.scan(UdevSource())
        assert self.full.scan(UdevSource()) == self.tree

    def step(self, batch: Sequence[UdevEvent], *, may_ask_full: bool = False) -> DeviceTree:
        """Rescan from ``batch``; assert it equals a full scan; return the new tree.

        With ``may_ask_full``, the scanner may answer None (asking for a full scan, which the
        daemon then runs); otherwise it must rescan.
        """
        rescanned = self.incremental.rescan(UdevSource(), self.tree, batch)
        if rescanned is None and may_ask_full:
            rescanned = self.incremental.scan(UdevSource())
        assert rescanned is not None
        expected = self.full.scan(UdevSource())
        assert rescanned == expected, (batch, dict(rescanned), dict(expected))
        # The scanner's kept index of sources is the one a fresh index of the tree gives.
        kept, fresh = self.incremental._index, SourceIndex(rescanned)
        if kept.tree is rescanned:
            assert kept.by_source == fresh.by_source
            assert kept.paths._sorted == fresh.paths._sorted
        self.tree = rescanned
        return rescanned

    def step_before_files_go(
        self, batch: Sequence[UdevEvent], gone: Callable[[], object]
    ) -> DeviceTree:
        """Rescan from ``batch`` while the removed devices' sysfs files are still there (the
        kernel sends ``remove``, then deletes them); ``gone()`` then deletes them, and the
        rescan must equal a full scan of the host as it is from then on."""
        rescanned = self.incremental.rescan(UdevSource(), self.tree, batch)
        assert rescanned is not None
        gone()
        expected = self.full.scan(UdevSource())
        assert rescanned == expected, (batch, dict(rescanned), dict(expected))
        self.tree = rescanned
        return rescanned


def ids(tree: DeviceTree, resource: str) -> list[str]:
    return sorted(tree.get(resource, {}))


# ------------------------------------------------------------------------- subsystems


def test_subsystems_are_those_of_the_entries() -> None:
    scanner = GenericScanner.from_config(
        [
            SERIAL_ENTRY,
            RENDER_ENTRY,
            {"resource": "example.com/tty", "match": {"subsystem": "tty"}},
        ]
    )
    assert scanner.subsystems == frozenset({"tty", "drm"})


def test_an_entry_matching_by_devnode_only_needs_every_subsystem() -> None:
    scanner = GenericScanner.from_config(
        [SERIAL_ENTRY, {"resource": CARD, "match": {"devnode": "/dev/dri/card*"}}]
    )
    assert scanner.subsystems is None


def test_no_entries_need_no_subsystems() -> None:
    assert GenericScanner.from_config([]).subsystems == frozenset()


# ----------------------------------------------------------------------- TouchedPaths


def touches(paths: TouchedPaths, source: str) -> bool:
    return paths.touched_sources([source]) == {source}


@pytest.mark.parametrize(
    ("event", "source", "touched"),
    [
        ("/sys/devices/a/b", "/sys/devices/a/b", True),  # the same path
        ("/sys/devices/a/b", "/sys/devices/a/b/c/d", True),  # the source lies below
        ("/sys/devices/a/b/c", "/sys/devices/a", True),  # the source lies above
        ("/sys/devices/a/b", "/sys/devices/a/bc", False),  # a sibling, common name prefix
        ("/sys/devices/a/bc", "/sys/devices/a/b", False),  # the other way round
        ("/sys/devices/a/b", "/sys/devices/a/bc/d", False),  # below the sibling
        ("/sys/devices/a/b/c", "/sys/devices/a/bc", False),  # a sibling of an ancestor
        ("/sys/devices/a/b", "/sys/devices/x/b", False),  # unrelated
    ],
)
def test_touches(event: str, source: str, touched: bool) -> None:
    assert touches(TouchedPaths([event]), source) is touched


def test_touches_with_several_event_paths() -> None:
    paths = TouchedPaths(["/sys/devices/a/b", "/sys/devices/x/y/z"])
    assert paths.paths == frozenset({"/sys/devices/a/b", "/sys/devices/x/y/z"})
    assert touches(paths, "/sys/devices/a/b/c")
    assert touches(paths, "/sys/devices/x/y")
    assert not touches(paths, "/sys/devices/a/bb")
    assert not touches(paths, "/sys/devices/x/yz")
    assert not touches(TouchedPaths([]), "/sys/devices/a/b")


def test_touched_sources_picks_exactly_the_touched_ones_from_many() -> None:
    sources = [
        "/sys/devices/z",
        "/sys/devices/a/bc/d",
        "/sys/devices/a/b/c/d",
        "/sys/devices/a",
        "/sys/devices/a/bc",
        "/sys/devices/a/b",
        "/sys/devices/a/b/c",
    ]
    assert TouchedPaths(["/sys/devices/a/b"]).touched_sources(sources) == {
        "/sys/devices/a",
        "/sys/devices/a/b",
        "/sys/devices/a/b/c",
        "/sys/devices/a/b/c/d",
    }


# ------------------------------------------------------------------- rescan == scan


def test_an_added_device_is_advertised(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    pair = Pair(SERIAL_ENTRY, RENDER_ENTRY)
    before = list(host.devices)
    add_usb_serial(host, index=1)
    add_intel_gpu(host, gpu_address(0), card=0, render=128)
    added = [p for p in host.devices if p not in before]
    tree = pair.step(events("add", added))
    assert ids(tree, SERIAL) == ["ttyUSB0", "ttyUSB1"]
    assert ids(tree, RENDER) == ["dri_renderD128"]
    assert tree[SERIAL]["ttyUSB1"].health is Health.HEALTHY


def test_an_event_for_the_device_alone_is_enough(host: UmockdevHost) -> None:
    pair = Pair(SERIAL_ENTRY)
    tty = add_usb_serial(host, index=3)
    tree = pair.step(events("add", [tty]))
    assert ids(tree, SERIAL) == ["ttyUSB3"]
    assert tree[SERIAL]["ttyUSB3"].sources == (tty,)


def test_removing_a_pci_parent_drops_its_drm_children(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    add_intel_gpu(host, gpu_address(1), card=1, render=129)
    card_entry = {"resource": CARD, "match": {"subsystem": "drm", "devnode": "/dev/dri/card*"}}
    pair = Pair(RENDER_ENTRY, card_entry)
    assert ids(pair.tree, RENDER) == ["dri_renderD128", "dri_renderD129"]
    removed = host.remove_device(first)
    assert len(removed) == 3  # card0, renderD128, then the PCI function
    # Only the parent's event: the children's sources lie below it.
    tree = pair.step([UdevEvent("remove", first, "pci")])
    assert ids(tree, RENDER) == ["dri_renderD129"]
    assert ids(tree, CARD) == ["dri_card1"]


def test_unplugging_a_usb_device_drops_its_tty(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    pair = Pair(SERIAL_ENTRY)
    removed = host.remove_device(usb_device(0))
    tree = pair.step(events("remove", removed))
    assert ids(tree, SERIAL) == ["ttyUSB1"]


def test_a_vanished_node_makes_an_advertised_device_unhealthy_until_it_is_back(
    host: UmockdevHost,
) -> None:
    tty = add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    pair = Pair(SERIAL_ENTRY)
    healthy = pair.tree[SERIAL]["ttyUSB0"]
    host.set_node_present(tty, False)
    tree = pair.step(events("change", [tty]))
    sick = tree[SERIAL]["ttyUSB0"]
    assert sick.health is Health.UNHEALTHY
    assert "/dev/ttyUSB0" in sick.health_reason
    assert sick.nodes == healthy.nodes and sick.sources == healthy.sources
    assert tree[SERIAL]["ttyUSB1"].health is Health.HEALTHY

    # Still unhealthy on a later, unrelated batch: its previous state is kept.
    still = pair.step(events("change", [usb_device(1)]))
    assert still[SERIAL]["ttyUSB0"].health is Health.UNHEALTHY

    host.set_node_present(tty, True)
    tree = pair.step(events("change", [tty]))
    assert tree[SERIAL]["ttyUSB0"] == healthy
    assert tree[SERIAL]["ttyUSB0"].health_reason == ""


# ------------------------------------------------- remove events are believed over sysfs


def test_a_remove_event_drops_the_device_while_sysfs_still_shows_it(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    add_intel_gpu(host, gpu_address(1), card=1, render=129)
    add_usb_serial(host, index=0)
    pair = Pair(RENDER_ENTRY, SERIAL_ENTRY)
    # The kernel's order: each child's remove, then the PCI function's, every one sent before
    # its directory (and here even its node) goes.
    batch = events("remove", host.removal_order(first))
    tree = pair.step_before_files_go(batch, lambda: host.remove_device(first))
    assert ids(tree, RENDER) == ["dri_renderD129"]
    assert ids(tree, SERIAL) == ["ttyUSB0"]


def test_a_parent_remove_drops_the_children_sysfs_still_shows(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    pair = Pair(SERIAL_ENTRY)
    # Only the USB device's event (its tty's own may come in a later batch, or not at all
    # for a consumer filtering by subsystem): what lies below a removed path is gone too.
    batch = [UdevEvent("remove", usb_device(0), "usb")]
    tree = pair.step_before_files_go(batch, lambda: host.remove_device(usb_device(0)))
    assert ids(tree, SERIAL) == ["ttyUSB1"]


def test_a_child_removed_in_one_batch_and_its_parent_in_the_next(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    card_entry = {"resource": CARD, "match": {"subsystem": "drm", "devnode": "/dev/dri/card*"}}
    pair = Pair(RENDER_ENTRY, card_entry)
    render = f"{first}/drm/renderD128"
    tree = pair.step_before_files_go(events("remove", [render]), lambda: host.remove_device(render))
    assert RENDER not in tree
    assert ids(tree, CARD) == ["dri_card0"]
    batch = events("remove", [f"{first}/drm/card0", first])
    assert len(pair.step_before_files_go(batch, lambda: host.remove_device(first))) == 0


def test_an_add_after_a_remove_in_one_batch_keeps_the_device(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    pair = Pair(RENDER_ENTRY)
    order = host.removal_order(first)
    # Removed and added again before the batch was taken: the last event of each path wins.
    batch = events("remove", order) + events("add", order[::-1])
    tree = pair.step(batch)
    assert ids(tree, RENDER) == ["dri_renderD128"]
    assert tree[RENDER]["dri_renderD128"].health is Health.HEALTHY


def test_an_add_after_a_removal_brings_the_device_back(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    pair = Pair(RENDER_ENTRY)
    order = host.removal_order(first)
    tree = pair.step_before_files_go(events("remove", order), lambda: host.remove_device(first))
    assert RENDER not in tree
    # Back at once, under the same paths: nothing remembers the removal beyond its batch.
    add_intel_gpu(host, gpu_address(0), card=0, render=128)
    tree = pair.step(events("add", order[::-1]))
    assert ids(tree, RENDER) == ["dri_renderD128"]


def test_the_previous_tree_passed_in_is_what_was_advertised(host: UmockdevHost) -> None:
    tty = add_usb_serial(host, index=0)
    previous = GenericScanner.from_config([SERIAL_ENTRY]).scan(UdevSource())
    host.set_node_present(tty, False)
    # A scanner that never scanned itself, given that tree: the device was advertised.
    fresh = GenericScanner.from_config([SERIAL_ENTRY])
    tree = fresh.rescan(UdevSource(), previous, events("change", [tty]))
    assert tree is not None
    assert tree[SERIAL]["ttyUSB0"].health is Health.UNHEALTHY


def test_an_event_on_an_ancestor_rereads_the_device(host: UmockdevHost) -> None:
    tty = add_usb_serial(host, index=0)
    pair = Pair(SERIAL_ENTRY)
    host.set_node_present(tty, False)
    tree = pair.step(events("change", [usb_device(0)]))
    assert tree[SERIAL]["ttyUSB0"].health is Health.UNHEALTHY


def test_a_drm_node_vanishing_under_a_gpu(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    pair = Pair(RENDER_ENTRY)
    render = f"{pci}/drm/renderD128"
    host.set_node_present(render, False)
    tree = pair.step(events("change", [render]))
    assert tree[RENDER]["dri_renderD128"].health is Health.UNHEALTHY
    assert "/dev/dri/renderD128" in tree[RENDER]["dri_renderD128"].health_reason
    # The GPU goes while its node is missing: the unhealthy device goes with it.
    host.remove_device(pci)
    assert len(pair.step([UdevEvent("remove", pci, "pci")])) == 0


def test_a_device_added_without_its_node_waits_for_the_node(host: UmockdevHost) -> None:
    pair = Pair(SERIAL_ENTRY)
    before = list(host.devices)
    tty = add_usb_serial(host, index=2)
    host.set_node_present(tty, False)
    tree = pair.step(events("add", [p for p in host.devices if p not in before]))
    assert SERIAL not in tree
    # A batch that re-reads it while the node is still missing does not advertise it either.
    assert SERIAL not in pair.step(events("change", [tty]))
    host.set_node_present(tty, True)
    tree = pair.step(events("change", [tty]))
    assert ids(tree, SERIAL) == ["ttyUSB2"]
    assert tree[SERIAL]["ttyUSB2"].health is Health.HEALTHY


def test_a_property_change_that_stops_the_match_drops_the_device(host: UmockdevHost) -> None:
    ftdi = add_usb_serial(host, index=0, vendor_id="0403")
    add_usb_serial(host, index=1, vendor_id="0403")
    pair = Pair(
        {
            "resource": SERIAL,
            "match": {"subsystem": "tty", "properties": {"ID_VENDOR_ID": "0403"}},
        }
    )
    assert ids(pair.tree, SERIAL) == ["ttyUSB0", "ttyUSB1"]
    host.set_property(ftdi, "ID_VENDOR_ID", "10c4")
    assert ids(pair.step(events("change", [ftdi])), SERIAL) == ["ttyUSB1"]
    host.set_property(ftdi, "ID_VENDOR_ID", "0403")
    assert ids(pair.step(events("change", [ftdi])), SERIAL) == ["ttyUSB0", "ttyUSB1"]


def test_a_glob_property_change_that_starts_the_match_adds_the_device(
    host: UmockdevHost,
) -> None:
    tty = add_usb_serial(host, index=0, model_id="6001")
    pair = Pair(
        {
            "resource": SERIAL,
            "match": {"subsystem": "tty", "properties": {"ID_MODEL_ID": "ea*"}},
        }
    )
    assert SERIAL not in pair.tree
    host.set_property(tty, "ID_MODEL_ID", "ea60")
    assert ids(pair.step(events("change", [tty])), SERIAL) == ["ttyUSB0"]


def test_events_for_unrelated_paths_leave_the_tree_unchanged(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=9)  # 1-10: a sibling of 1-1 with a common name prefix
    pci = add_intel_gpu(host, gpu_address(0), card=0, render=128)
    other = add_pci_device(host, "0000:00:05.0", vendor="0x1234", device="0x0001", driver=None)
    pair = Pair(SERIAL_ENTRY)
    before = pair.tree
    batch = [
        UdevEvent("change", pci, "pci"),
        UdevEvent("change", f"{pci}/drm/card0", "drm"),
        UdevEvent("change", other, "pci"),
        UdevEvent("bind", other, "pci"),
        UdevEvent("remove", "/sys/devices/pci0000:00/0000:00:06.0", "pci"),  # never existed
        UdevEvent("change", "/sys/devices/virtual/misc/nothing", "misc"),
    ]
    assert pair.step(batch) == before
    assert ids(before, SERIAL) == ["ttyUSB0", "ttyUSB9"]
    assert pair.step([]) == before


def test_an_event_does_not_reread_a_sibling_with_a_common_name_prefix(
    host: UmockdevHost,
) -> None:
    add_usb_serial(host, index=0)  # below .../usb1/1-1
    sibling = add_usb_serial(host, index=9)  # below .../usb1/1-10
    pair = Pair(SERIAL_ENTRY)
    # The sibling's node goes without an event of its own: only a re-read would notice.
    host.set_node_present(sibling, False)
    tree = pair.incremental.rescan(UdevSource(), pair.tree, events("change", [usb_device(0)]))
    assert tree == pair.tree
    assert tree is not None and tree[SERIAL]["ttyUSB9"].health is Health.HEALTHY


def test_shares_give_every_id_the_same_fate(host: UmockdevHost) -> None:
    tty = add_usb_serial(host, index=0)
    pair = Pair({"resource": SERIAL, "match": {"subsystem": "tty"}, "shares": 2})
    assert ids(pair.tree, SERIAL) == ["ttyUSB0-0", "ttyUSB0-1"]
    before = list(host.devices)
    add_usb_serial(host, index=1)
    tree = pair.step(events("add", [p for p in host.devices if p not in before]))
    assert ids(tree, SERIAL) == ["ttyUSB0-0", "ttyUSB0-1", "ttyUSB1-0", "ttyUSB1-1"]
    host.set_node_present(tty, False)
    tree = pair.step(events("change", [tty]))
    assert {i: d.health for i, d in tree[SERIAL].items()} == {
        "ttyUSB0-0": Health.UNHEALTHY,
        "ttyUSB0-1": Health.UNHEALTHY,
        "ttyUSB1-0": Health.HEALTHY,
        "ttyUSB1-1": Health.HEALTHY,
    }
    removed = host.remove_device(usb_device(0))
    tree = pair.step(events("remove", removed))
    assert ids(tree, SERIAL) == ["ttyUSB1-0", "ttyUSB1-1"]


# ------------------------------------------------------------ a random walk of changes


class RandomHost:
    """Random hotplug on a umockdev host, yielding the events the kernel would send."""

    def __init__(self, host: UmockdevHost, rng: random.Random) -> None:
        self.host = host
        self.rng = rng
        self.serials: dict[int, str] = {}  # index -> tty path
        self.gpus: dict[int, str] = {}  # slot -> PCI path
        self.counts = {"add": 0, "remove": 0, "flip": 0, "parent-only": 0}

    def nodes(self) -> list[str]:
        """Paths of present devices that have a node we may flip."""
        found = list(self.serials.values())
        for pci in self.gpus.values():
            found += [p for p in self.host.devices if p.startswith(pci + "/drm/")]
        return found

    def _added_since(self, before: list[str]) -> list[UdevEvent]:
        known = set(before)
        return events("add", [p for p in self.host.devices if p not in known])

    def _removed(self, path: str) -> list[UdevEvent]:
        removed = self.host.remove_device(path)
        self.counts["remove"] += 1
        if self.rng.random() < 0.3:
            # Only the top device's event: everything below it must go all the same.
            self.counts["parent-only"] += 1
            return [UdevEvent("remove", path, None)]
        return events("remove", removed)

    def step(self) -> list[UdevEvent]:
        rng = self.rng
        choice = rng.random()
        before = list(self.host.devices)
        if choice < 0.25:
            free = [i for i in range(126) if i not in self.serials]
            index = rng.choice(free)
            self.serials[index] = add_usb_serial(self.host, index=index)
            self.counts["add"] += 1
            if rng.random() < 0.2:
                self.host.set_node_present(self.serials[index], False)
            return self._added_since(before)
        if choice < 0.4:
            slot = rng.choice([s for s in range(32) if s not in self.gpus])
            self.gpus[slot] = add_intel_gpu(
                self.host, gpu_address(slot), card=slot, render=128 + slot
            )
            self.counts["add"] += 1
            return self._added_since(before)
        if choice < 0.6 and (self.serials or self.gpus):
            if self.serials and (not self.gpus or rng.random() < 0.5):
                if rng.random() < 0.1:
                    self.serials.clear()  # the USB controller goes, and every adapter with it
                    return self._removed(USB_CONTROLLER)
                index = rng.choice(sorted(self.serials))
                del self.serials[index]
                return self._removed(usb_device(index))
            slot = rng.choice(sorted(self.gpus))
            return self._removed(self.gpus.pop(slot))
        nodes = self.nodes()
        if not nodes:
            return []
        path = rng.choice(nodes)
        self.host.set_node_present(path, rng.random() < 0.5)
        self.counts["flip"] += 1
        return events("change", [path])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_random_walk_of_changes_rescans_like_full_scans(host: UmockdevHost, seed: int) -> None:
    walk = RandomHost(host, random.Random(seed))
    pair = Pair(
        SERIAL_ENTRY,
        RENDER_ENTRY,
        # By node only (every subsystem's events matter), with shares.
        {"resource": CARD, "match": {"devnode": "/dev/dri/card*"}, "shares": 2},
    )
    unhealthy_seen = most_devices = 0
    for _ in range(100):
        tree = pair.step(walk.step())
        most_devices = max(most_devices, tree.device_count())
        unhealthy_seen += any(
            not info.healthy for devices in tree.values() for info in devices.values()
        )
    # The walk did what it is here for.
    assert walk.counts["add"] >= 10 and walk.counts["remove"] >= 5 and walk.counts["flip"] >= 10
    assert walk.counts["parent-only"] >= 1
    assert unhealthy_seen >= 5 and most_devices >= 8


# ------------------------------------------------------------- duplicate ids and moves


def test_a_device_shadowed_by_a_duplicate_id_appears_when_the_winner_goes(
    host: UmockdevHost,
) -> None:
    # Two clone adapters with the same serial (common with cheap FTDI clones): one id, the
    # first one found wins. Unplug it: a full scan now finds the other one under that id.
    add_usb_serial(host, index=0, serial="A50285BI")
    clone = add_usb_serial(host, index=1)
    host.set_property(clone, "ID_SERIAL_SHORT", "A50285BI")
    pair = Pair(
        {"resource": SERIAL, "match": {"subsystem": "tty"}, "id_property": "ID_SERIAL_SHORT"}
    )
    assert pair.tree[SERIAL]["A50285BI"].nodes[0].host_path == "/dev/ttyUSB0"
    removed = host.remove_device(usb_device(0))
    tree = pair.step(events("remove", removed), may_ask_full=True)
    assert tree[SERIAL]["A50285BI"].nodes[0].host_path == "/dev/ttyUSB1"


def test_a_moved_device_follows_its_new_path_and_goes_with_it(host: UmockdevHost) -> None:
    # The kernel moves an rfcomm tty between its virtual home and the Bluetooth connection
    # (device_move); the "move" event names only the new path.
    entry = {"resource": SERIAL, "match": {"subsystem": "tty", "devnode": "/dev/rfcomm*"}}
    old = host.add_device(
        "/sys/devices/virtual/tty/rfcomm0", "tty", node=MockNode("rfcomm0", 216, 0)
    )
    parent = add_pci_device(host, "0000:00:05.0", vendor="0x8086", device="0x1234", driver=None)
    pair = Pair(entry)
    host.remove_device(old)
    new = host.add_device(f"{parent}/tty/rfcomm0", "tty", node=MockNode("rfcomm0", 216, 0))
    moved = pair.step([UdevEvent("move", new, "tty")], may_ask_full=True)
    assert moved[SERIAL]["rfcomm0"].sources == (new,)
    host.remove_device(new)
    assert SERIAL not in pair.step([UdevEvent("remove", new, "tty")], may_ask_full=True)


def test_a_moved_device_with_a_path_based_id_leaves_no_stale_entry(host: UmockdevHost) -> None:
    # With id_property ID_PATH (stable across renumbering), a move changes the device's id:
    # the entry built from the old path must go, though no event names that path.
    entry = {
        "resource": SERIAL,
        "match": {"subsystem": "tty", "devnode": "/dev/rfcomm*"},
        "id_property": "ID_PATH",
    }
    old = host.add_device(
        "/sys/devices/virtual/tty/rfcomm0",
        "tty",
        node=MockNode("rfcomm0", 216, 0),
        properties={"ID_PATH": "virtual-rfcomm0"},
    )
    parent = add_pci_device(host, "0000:00:05.0", vendor="0x8086", device="0x1234", driver=None)
    pair = Pair(entry)
    assert ids(pair.tree, SERIAL) == ["virtual-rfcomm0"]
    host.remove_device(old)
    new = host.add_device(
        f"{parent}/tty/rfcomm0",
        "tty",
        node=MockNode("rfcomm0", 216, 0),
        properties={"ID_PATH": "pci-0000_00_05_0"},
    )
    # The events as the monitor hands them over: the kernel's move names the old path in
    # DEVPATH_OLD, which the monitor turns into a remove of that path.
    monitor = UdevMonitor("kernel", frozenset({"tty"}))
    try:
        host.emit("move", new, {"DEVPATH_OLD": old.removeprefix("/sys")})
        received = monitor.receive(limit=10).events
    finally:
        monitor.close()
    assert received == (UdevEvent("remove", old, "tty"), UdevEvent("move", new, "tty"))
    moved = pair.step(received, may_ask_full=True)
    assert ids(moved, SERIAL) == ["pci-0000_00_05_0"]

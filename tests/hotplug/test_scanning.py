"""ScanRunner: incremental rescans, their fallback to full scans, and failure handling."""

from __future__ import annotations

from collections.abc import Sequence

from devplug.hotplug.scanning import ScanRunner, event_subsystems
from devplug.model import DeviceInfo, DeviceTree
from devplug.scanners.udev import UdevEvent, UdevSource
from devplug.scanners.vfio import VfioScanner
from devplug.testing import StaticScanner
from devplug.testing.umockdev import (
    UmockdevHost,
    add_vfio_container,
    add_vfio_function,
    add_vfio_group,
)

RESOURCE = "example.com/thing"
EVENT = UdevEvent("change", "/sys/devices/virtual/misc/thing0", "misc")


class CountingScanner(StaticScanner):
    """An incremental scanner whose rescan answers from ``rescan_result`` (or raises it)."""

    def __init__(self, devices: dict[str, DeviceInfo]) -> None:
        super().__init__({RESOURCE: devices})
        self.full = 0
        self.rescans: list[Sequence[UdevEvent]] = []
        self.rescan_result: DeviceTree | Exception | None = None

    @property
    def subsystems(self) -> frozenset[str] | None:
        return frozenset({"misc"})

    def scan(self, source: UdevSource) -> DeviceTree:
        self.full += 1
        return super().scan(source)

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None:
        self.rescans.append(events)
        if isinstance(self.rescan_result, Exception):
            raise self.rescan_result
        return self.rescan_result


def test_events_go_to_rescan_and_none_means_a_full_scan() -> None:
    scanner = CountingScanner({"a": DeviceInfo()})
    runner = ScanRunner([scanner])
    runner.scan_blocking()  # the first scan is always full: there is no previous tree
    assert scanner.full == 1

    scanner.rescan_result = DeviceTree({RESOURCE: {"b": DeviceInfo()}})
    result = runner.scan_blocking(events=[EVENT])
    assert (result.full, result.incremental) == (0, 1)
    assert scanner.rescans == [[EVENT]]
    assert set(result.tree[RESOURCE]) == {"b"}

    scanner.rescan_result = None  # "I cannot do this one incrementally"
    result = runner.scan_blocking(events=[EVENT])
    assert (result.full, result.incremental) == (1, 0)
    assert set(result.tree[RESOURCE]) == {"a"}


def test_a_failing_rescan_falls_back_to_a_full_scan_not_the_old_tree() -> None:
    scanner = CountingScanner({"a": DeviceInfo()})
    runner = ScanRunner([scanner])
    runner.scan_blocking()
    scanner.set({RESOURCE: {"a": DeviceInfo(), "new": DeviceInfo()}})
    scanner.rescan_result = RuntimeError("sysfs hiccup")
    result = runner.scan_blocking(events=[EVENT])
    # The events are consumed: only a full scan can still account for them.
    assert (result.full, result.incremental) == (1, 0)
    assert set(result.tree[RESOURCE]) == {"a", "new"}


def test_plain_scanners_scan_fully_on_events_and_widen_the_monitor_filter() -> None:
    plain = StaticScanner({"example.com/other": {"x": DeviceInfo()}})
    incremental = CountingScanner({"a": DeviceInfo()})
    runner = ScanRunner([incremental, plain])
    runner.scan_blocking()
    incremental.rescan_result = DeviceTree({RESOURCE: {"a": DeviceInfo()}})
    result = runner.scan_blocking(events=[EVENT])
    assert (result.full, result.incremental) == (1, 1)
    assert event_subsystems([incremental]) == frozenset({"misc"})
    assert event_subsystems([incremental, plain]) is None  # a plain scanner may need any event


# ----------------------------------------- remove events are believed over what sysfs shows

GPU = "/sys/devices/pci0000:00/0000:00:02.0"
CARD = f"{GPU}/drm/card0"
RENDER = f"{GPU}/drm/renderD128"


def remove(*paths: str) -> list[UdevEvent]:
    return [UdevEvent("remove", path, None) for path in paths]


def test_after_a_remove_a_full_scan_leaves_out_what_was_built_only_from_removed_devices() -> None:
    """A plain scanner sees sysfs as it is, which may still show a device whose remove event
    has come (the kernel deletes its directory after sending it)."""
    scanner = StaticScanner(
        {
            RESOURCE: {
                "render": DeviceInfo(sources=(RENDER,)),
                "card": DeviceInfo(sources=(CARD,)),
                "gpu": DeviceInfo(sources=(GPU, CARD, RENDER)),
                "unsourced": DeviceInfo(),
            }
        }
    )
    runner = ScanRunner([scanner])
    assert len(runner.scan_blocking().tree[RESOURCE]) == 4
    # The render minor's remove: the GPU still has a source that is not gone.
    result = runner.scan_blocking(events=remove(RENDER))
    assert set(result.tree[RESOURCE]) == {"card", "gpu", "unsourced"}
    # The PCI function's remove covers the minors below it.
    assert set(runner.scan_blocking(events=remove(GPU)).tree[RESOURCE]) == {"unsourced"}
    # Removed, then added again before the batch was taken: the add is the last word.
    readded = [*remove(RENDER), UdevEvent("add", RENDER, "drm")]
    assert set(runner.scan_blocking(events=readded).tree[RESOURCE]) == {
        "render",
        "card",
        "gpu",
        "unsourced",
    }
    # A scan without events (start-up, resync, SIGHUP) believes sysfs alone.
    assert len(runner.scan_blocking().tree[RESOURCE]) == 4


def test_an_incremental_rescan_that_reads_a_removed_device_again_loses_it() -> None:
    scanner = CountingScanner({"kept": DeviceInfo(sources=(CARD,))})
    runner = ScanRunner([scanner])
    first = runner.scan_blocking().tree
    # A rescan that re-read the removed minor from sysfs (as a scanner following the events'
    # paths alone would) and built it again.
    scanner.rescan_result = first.with_changes(
        [], {RESOURCE: {"render": DeviceInfo(sources=(RENDER,))}}
    )
    result = runner.scan_blocking(events=remove(RENDER))
    assert (result.full, result.incremental) == (0, 1)
    assert set(result.tree[RESOURCE]) == {"kept"}


def test_a_removed_vfio_function_leaves_at_its_event(host: UmockdevHost) -> None:
    """The VFIO scanner scans fully on PCI events: a function whose remove event came while
    sysfs still shows it is gone with its group."""
    add_vfio_container(host)
    for group, address in ((7, "0000:03:00.0"), (8, "0000:04:00.0")):
        add_vfio_group(host, group)
        add_vfio_function(host, address, vendor="0x10de", device="0x2330", group=group)
    runner = ScanRunner([VfioScanner()])
    resource = next(iter(runner.scan_blocking().tree))
    assert set(runner.scan_blocking().tree[resource]) == {"0000:03:00.0", "0000:04:00.0"}
    result = runner.scan_blocking(events=remove("/sys/devices/pci0000:03/0000:03:00.0"))
    assert set(result.tree[resource]) == {"0000:04:00.0"}


def test_a_report_section_named_resources_or_taken_twice_is_dropped() -> None:
    import structlog

    from devplug.hotplug.scanning import ScanRunner
    from devplug.model import DeviceTree as Tree
    from devplug.scanners.udev import UdevSource as Source

    class Reporting:
        def __init__(self, name: str, sections: dict[str, object]) -> None:
            self.name = name
            self.sections = sections

        def scan(self, source: Source) -> Tree:
            return Tree()

        def report(self) -> dict[str, object]:
            return self.sections

    first = Reporting("one", {"resources": ["bogus"], "found": [1]})
    second = Reporting("two", {"found": [2], "other": [3]})
    with structlog.testing.capture_logs() as logs:
        result = ScanRunner([first, second]).scan_blocking()
    assert result.extras == {"found": [1], "other": [3]}
    clashes = [(e["scanner"], e["section"]) for e in logs if e["event"] == "scan.report.clash"]
    assert clashes == [("one", "resources"), ("two", "found")]

"""ScanRunner: incremental rescans, their fallback to full scans, and failure handling."""

from __future__ import annotations

from collections.abc import Sequence

from devplug.hotplug.scanning import ScanRunner, event_subsystems
from devplug.model import DeviceInfo, DeviceTree
from devplug.scanners.udev import UdevEvent, UdevSource
from devplug.testing import StaticScanner

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

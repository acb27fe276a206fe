"""``devplug capture``: what the configured scanners read of this host, scrubbed, in umockdev's
record format, for a bug report; ``devplug scan --replay FILE`` (:mod:`.replay`) scans it.

The capture holds every device of the subsystems the scanners watch (every device when one of
them matches by node only) and each device above them, with their udev properties, sysfs
attributes and links, /dev nodes and the links to them (:mod:`devplug.scanners.udev.snapshot`),
identifying values replaced (:mod:`.scrub`); a record that would still hold one is not
written. It then runs the scan as ``devplug scan`` would and says on stderr when the scan's
output holds a scrubbed value (device ids made from ``ID_SERIAL_SHORT``, say): a replay shows
placeholders there unless ``--keep`` names it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from devplug._kits.atomic import replace_file
from devplug.cli.commands import fail, scanners_failed
from devplug.cli.parser import EXIT_FAILED, EXIT_OK
from devplug.cli.scrub import Scrubber
from devplug.hotplug.scanning import ScanRunner, event_subsystems
from devplug.scanners.base import Scanner
from devplug.scanners.udev import SourceUnavailable
from devplug.scanners.udev.record import (
    RecordedDevice,
    RecordError,
    format_record,
    parse_record,
)
from devplug.scanners.udev.snapshot import DeviceSnapshot, snapshot_devices


def capture(
    program: str, scanners: Sequence[Scanner], output: Path | None, keep: Sequence[str]
) -> int:
    """Write the record to ``output`` (None or ``-``: stdout); say what was captured."""
    subsystems = event_subsystems(scanners)
    try:
        snapshot = snapshot_devices(subsystems)
    except SourceUnavailable as exc:
        fail(program, f"cannot capture: {exc}")
        return EXIT_FAILED
    for path, problem in sorted(snapshot.problems.items()):
        fail(program, f"note: {path}: {problem}")
    scrubber = Scrubber(keep)
    scrubber.collect(snapshot.devices)
    devices = _loadable(program, [(d, scrubber.device(d)) for d in snapshot.devices])
    record = format_record(devices)
    try:
        parse_record(record.encode(), source="the capture")
    except RecordError as exc:  # a bug: what capture writes, replay must read
        fail(program, f"cannot capture: the record would not load: {exc}")
        return EXIT_FAILED
    leaked = sorted({name for names in scrubber.leaks(record).values() for name in names})
    if leaked:  # a bug: nothing identifying leaves the host unless --keep names it
        fail(
            program,
            "cannot capture: the record would still hold values found under "
            f"{', '.join(leaked)} (please report this); "
            + " ".join(f"--keep {name}" for name in leaked)
            + " records them as they are",
        )
        return EXIT_FAILED
    to_stdout = output is None or str(output) == "-"
    if to_stdout:
        sys.stdout.write(record)
        sys.stdout.flush()
    else:
        assert output is not None
        try:
            replace_file(output, record.encode(), _new_file_mode(), f".{output.name}.devplug-")
        except OSError as exc:
            fail(program, f"cannot write {output}: {exc.strerror or exc}")
            return EXIT_FAILED
    watched = "every subsystem" if subsystems is None else ", ".join(sorted(subsystems))
    where = "stdout" if to_stdout else str(output)
    print(
        f"{program}: captured {len(devices)} devices ({watched}, and the devices above them) to "
        f"{where}; {scrubber.scrubbed} identifying values scrubbed",
        file=sys.stderr,
    )
    _say_what_replay_changes(program, scanners, scrubber)
    return EXIT_OK


def _loadable(
    program: str, devices: Sequence[tuple[DeviceSnapshot, RecordedDevice]]
) -> list[RecordedDevice]:
    """The devices whose paragraph a replay can load; each other one is named and left out
    (a sysfs entry stranger than the format can hold, rather than no capture at all)."""
    kept = []
    for snapshot, device in devices:
        try:
            parse_record(format_record([device]).encode(), source="the capture")
        except (RecordError, ValueError) as exc:
            fail(program, f"note: left {snapshot.sys_path} out of the capture: {exc}")
            continue
        kept.append(device)
    return kept


def _say_what_replay_changes(program: str, scanners: Sequence[Scanner], scrubber: Scrubber) -> None:
    """Scan as ``devplug scan -o json`` does; name the scrubbed values its output holds."""
    from devplug.cli.report import render

    result = ScanRunner(scanners).scan_blocking()
    scanners_failed(program, result.failure_reasons)
    shown = scrubber.appearing_in(render(result.tree, "json", result.extras))
    names = sorted({name for found in shown.values() for name in found})
    if names:
        fail(
            program,
            f"note: this host's scan output holds values scrubbed from {', '.join(names)}: "
            "'devplug scan --replay' shows placeholders in their place; "
            + " ".join(f"--keep {name}" for name in names)
            + " records them as they are",
        )


def _new_file_mode() -> int:
    """The mode a new file gets from this process's umask, as ``open()`` would give it."""
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask

"""``devplug capture`` and ``devplug scan --replay`` (issue 28.3): a host recorded in umockdev's
record format, identifying values scrubbed, scans the same when replayed: this machine's real
devices and every shipped preset, byte for byte in ``scan -o json``. A hostile record is
refused before it names a file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from devplug.cli.scrub import Scrubber
from devplug.scanners.udev.snapshot import DeviceSnapshot
from devplug.testing.mockhost import PRESETS, build_mock_host
from devplug.testing.umockdev import (
    RecordedDevice,
    RecordError,
    UmockdevHost,
    add_usb_serial,
    format_record,
    parse_record,
    read_record,
)
from devplug.testing.umockdev.record import MAX_RECORD_BYTES, MAX_VALUE_BYTES, escape, unescape

ROOT = Path(__file__).resolve().parents[1]
# The memory devices and virtual consoles: on every Linux machine, this one included.
REAL_DEVICES_CONFIG = ROOT / "examples" / "dry-run.yaml"
PRESET_CONFIGS = {
    "serial": ROOT / "examples" / "serial.yaml",
    "intel-gpu": ROOT / "examples" / "intel-gpu.yaml",
    "vfio": ROOT / "examples" / "vfio.yaml",
}


def environment(
    *, testbed: Path | None = None, preload: bool = True, **extra: str
) -> dict[str, str]:
    """This process's environment for a child: the machine's own devices, or ``testbed``'s;
    with umockdev's preload or (``preload=False``) without."""
    env = {k: v for k, v in os.environ.items() if k not in ("UMOCKDEV_DIR", "LD_PRELOAD")}
    if preload:
        env["LD_PRELOAD"] = "libumockdev-preload.so.0"
    if testbed is not None:
        env["UMOCKDEV_DIR"] = str(testbed)
    return {**env, **extra}


def run(
    *args: str, env: Mapping[str, str], module: str = "devplug"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=dict(env),
        timeout=120,
        check=False,
    )


def scan_json(config: Path, env: Mapping[str, str], *replay: str) -> str:
    result = run("scan", "--config", str(config), "-o", "json", *replay, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def capture(config: Path, output: Path, env: Mapping[str, str], *flags: str) -> str:
    """Capture to ``output``; returns stderr."""
    result = run("capture", "--config", str(config), "-o", str(output), *flags, env=env)
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.fixture(autouse=True)
def _needs_umockdev() -> None:
    if shutil.which("umockdev-wrapper") is None:
        pytest.skip("needs umockdev")


# ---------------------------------------------------------------------------------- round trips


@dataclass(frozen=True)
class MachineCapture:
    live: str  # ``scan -o json`` of this machine
    record: Path
    said: str  # what capture wrote on stderr


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> MachineCapture:
    """This machine's real devices, scanned and captured once for the tests below."""
    if shutil.which("umockdev-wrapper") is None:
        pytest.skip("needs umockdev")
    live = scan_json(REAL_DEVICES_CONFIG, environment())
    record = tmp_path_factory.mktemp("machine") / "machine.umockdev"
    said = capture(REAL_DEVICES_CONFIG, record, environment())
    return MachineCapture(live, record, said)


def test_this_machines_real_devices_scan_the_same_when_replayed(machine: MachineCapture) -> None:
    assert '"example.com/mem"' in machine.live and '"/dev/null"' in machine.live
    assert re.search(r"captured \d+ devices \(mem, tty, and the devices above them\)", machine.said)
    assert "P: /devices/virtual/mem/null\nN: null\n" in machine.record.read_text()
    # Replayed without the preload: the command starts itself again under it.
    replayed = scan_json(
        REAL_DEVICES_CONFIG, environment(preload=False), "--replay", str(machine.record)
    )
    assert replayed == machine.live


def test_a_replay_scans_the_record_not_the_machine(machine: MachineCapture, tmp_path: Path) -> None:
    paragraphs = machine.record.read_text().split("\n\n")
    without_zero = [p for p in paragraphs if not p.startswith("P: /devices/virtual/mem/zero\n")]
    assert len(without_zero) == len(paragraphs) - 1
    edited = tmp_path / "edited.umockdev"
    edited.write_text("\n\n".join(without_zero))
    replayed = scan_json(REAL_DEVICES_CONFIG, environment(), "--replay", str(edited))
    assert '"/dev/null"' in replayed and '"/dev/zero"' not in replayed


def test_mock_host_from_a_record_is_the_recorded_host(
    machine: MachineCapture, tmp_path: Path
) -> None:
    testbed = tmp_path / "tb"
    mock_host = ("mock-host", str(testbed), "--from", str(machine.record))
    built = run(*mock_host, env=environment(), module="devplug.testing")
    assert built.returncode == 0, built.stderr
    assert built.stdout == f"UMOCKDEV_DIR={testbed}\n"
    assert scan_json(REAL_DEVICES_CONFIG, environment(testbed=testbed)) == machine.live
    again = run(*mock_host, env=environment(), module="devplug.testing")
    assert again.returncode == 1 and "is not empty" in again.stderr


@pytest.mark.skipif(shutil.which("umockdev-run") is None, reason="needs umockdev-run")
def test_umockdev_itself_loads_a_capture(machine: MachineCapture) -> None:
    """The record is umockdev's format: umockdev-run builds the same host from it."""
    command = ["umockdev-run", "-d", str(machine.record), "--", sys.executable, "-m", "devplug"]
    result = subprocess.run(
        [*command, "scan", "--config", str(REAL_DEVICES_CONFIG), "-o", "json"],
        capture_output=True,
        text=True,
        env=environment(preload=False),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == machine.live


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_survives_capture_and_replay(preset: str, short_dir: Path) -> None:
    assert set(PRESET_CONFIGS) == set(PRESETS), "a new preset needs its config here"
    config = PRESET_CONFIGS[preset]
    host = build_mock_host(short_dir / "preset", preset)
    on_preset = environment(testbed=host.root)
    live = scan_json(config, on_preset)
    assert '"resources": {}' not in live
    record = short_dir / f"{preset}.umockdev"
    capture(config, record, on_preset)
    assert scan_json(config, environment(), "--replay", str(record)) == live
    # Unchanged: the host built from the record captures to the same record.
    rebuilt = short_dir / "rebuilt"
    made = run(
        "mock-host",
        str(rebuilt),
        "--from",
        str(record),
        env=environment(),
        module="devplug.testing",
    )
    assert made.returncode == 0, made.stderr
    again = short_dir / "again.umockdev"
    capture(config, again, environment(testbed=rebuilt))
    assert again.read_bytes() == record.read_bytes()


# ---------------------------------------------------------------------------------- scrubbing

SERIAL = "FT8KQ2ZX"
MAC = "52:54:00:ab:cd:ef"


def _identified_host(short_dir: Path) -> UmockdevHost:
    """A USB serial adapter with a serial number, and a network card with a MAC address."""
    host = UmockdevHost(short_dir / "tb")
    add_usb_serial(host, index=0, serial=SERIAL)
    host.add_device(
        "/sys/devices/virtual/net/enx525400abcdef",
        "net",
        attributes={"address": MAC + "\n", "mtu": "1500\n"},
        properties={"INTERFACE": "enx525400abcdef", "ID_NET_NAME_MAC": "enx525400abcdef"},
    )
    return host


def _serial_config(short_dir: Path) -> Path:
    config = short_dir / "serial.yaml"
    config.write_text(
        "scanners:\n  generic:\n"
        "    - resource: example.com/serial\n"
        "      match: {subsystem: tty, devnode: /dev/ttyUSB*}\n"
        "      id_property: ID_SERIAL_SHORT\n"
        "    - resource: example.com/nic\n"
        "      match: {subsystem: net}\n"
    )
    return config


def test_serials_and_addresses_are_scrubbed_and_relations_kept(short_dir: Path) -> None:
    host = _identified_host(short_dir)
    config = _serial_config(short_dir)
    record = short_dir / "scrubbed.umockdev"
    said = capture(config, record, environment(testbed=host.root))
    # The serial, the MAC address, and the interface name made of it (ID_NET_NAME_MAC).
    assert "3 identifying values scrubbed" in said
    data = record.read_bytes()
    for planted in (SERIAL, MAC, MAC.replace(":", ""), "525400ABCDEF"):
        assert planted.encode() not in data, planted
        assert planted.encode().hex().upper().encode() not in data, planted
    (tty,) = [d for d in parse_record(data) if d.node == "ttyUSB0"]
    placeholder = tty.properties["ID_SERIAL_SHORT"]
    # The by-id link still names the tty's serial, and the USB device's serial attribute too.
    assert tty.devlinks == (f"serial/by-id/usb-0403_6001_{placeholder}-if00-port0",)
    (usb,) = [d for d in parse_record(data) if d.sys_path.endswith("/usb1/1-1")]
    assert usb.attributes["serial"] == placeholder.encode()
    (nic,) = [d for d in parse_record(data) if d.subsystem == "net"]
    scrubbed_mac = nic.attributes["address"].decode()
    assert re.fullmatch(r"02:00:00:[0-9a-f]{2}:[0-9a-f]{2}:[0-9a-f]{2}\n", scrubbed_mac)
    # The interface's name held its MAC address: its dir, INTERFACE and ID_NET_NAME_MAC agree.
    name = nic.sys_path.rsplit("/", 1)[1]
    assert name == nic.properties["INTERFACE"] == nic.properties["ID_NET_NAME_MAC"]


def test_ids_made_from_a_scrubbed_value_are_named_and_kept_with_keep(short_dir: Path) -> None:
    host = _identified_host(short_dir)
    config = _serial_config(short_dir)
    on_host = environment(testbed=host.root)
    live = scan_json(config, on_host)
    assert f'"id": "{SERIAL}"' in live
    scrubbed = short_dir / "scrubbed.umockdev"
    said = capture(config, scrubbed, on_host)
    assert "holds values scrubbed from ID_SERIAL_SHORT" in said
    assert "--keep ID_SERIAL_SHORT" in said
    replayed = scan_json(config, environment(), "--replay", str(scrubbed))
    assert SERIAL not in replayed and replayed != live
    kept = short_dir / "kept.umockdev"
    said = capture(config, kept, on_host, "--keep", "ID_SERIAL_SHORT")
    assert "holds values scrubbed" not in said
    assert scan_json(config, environment(), "--replay", str(kept)) == live
    assert MAC.encode() not in kept.read_bytes()  # what --keep does not name is still scrubbed


def test_scrubbing_takes_identifying_values_only_and_the_same_way_each_time() -> None:
    def nic(name: str, address: str) -> DeviceSnapshot:
        return DeviceSnapshot(
            f"/sys/devices/virtual/net/{name}",
            {"INTERFACE": name, "SUBSYSTEM": "net"},
            {
                "address": f"{address}\n".encode(),
                "addr_len": b"6\n",
                "addr_assign_type": b"0\n",
                "broadcast": b"ff:ff:ff:ff:ff:ff\n",
            },
            {},
        )

    # Two interfaces that share an address (a bond's members), and the loopback's zeros.
    devices = [nic("eth0", MAC), nic("eth1", MAC), nic("lo", "00:00:00:00:00:00")]
    records = []
    for _ in range(2):
        scrubber = Scrubber()
        scrubber.collect(devices)
        records.append(format_record(scrubber.device(d) for d in devices))
    assert records[0] == records[1]
    eth0, eth1, lo = parse_record(records[0].encode())
    assert eth0.attributes["address"] == eth1.attributes["address"] != f"{MAC}\n".encode()
    assert lo.attributes["address"] == b"00:00:00:00:00:00\n"
    for device in (eth0, lo):
        assert device.attributes["addr_len"] == b"6\n"
        assert device.attributes["addr_assign_type"] == b"0\n"
        assert device.attributes["broadcast"] == b"ff:ff:ff:ff:ff:ff\n"


# ---------------------------------------------------------------------------------- hostile records

GOOD = "P: /devices/virtual/mem/x\nN: x\nE: SUBSYSTEM=mem\nE: MAJOR=1\nE: MINOR=3\n"


@pytest.mark.parametrize(
    ("record", "named"),
    [
        ("P: /devices/../../etc\nE: SUBSYSTEM=mem\n", "device path"),
        ("P: /sys/devices/x\nE: SUBSYSTEM=mem\n", "start with /devices/"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nA: ../../../etc/passwd=x\n", "relative path"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nA: /etc/passwd=x\n", "relative path"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nL: l=../../../../tmp/out\n", "leads out of /sys"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nL: l=/tmp/out\n", "leads out of /sys"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nL: l=../a/../../../../tmp\n", "'../' steps then names"),
        ("P: /devices/x\nN: ../../etc/x\nE: SUBSYSTEM=mem\nE: MAJOR=1\nE: MINOR=1\n", "below /dev"),
        ("P: /devices/x\nN: .node/x\nE: SUBSYSTEM=mem\nE: MAJOR=1\nE: MINOR=1\n", "below /dev"),
        (
            "P: /devices/x\nN: x\nS: ../../tmp/out\nE: SUBSYSTEM=mem\nE: MAJOR=1\nE: MINOR=1\n",
            "below /dev",
        ),
        ("P: /devices/x\nE: SUBSYSTEM=../../etc\n", "SUBSYSTEM"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nA: uevent=DEVNAME=../../etc/passwd\n", "uevent"),
        (
            "P: /devices/x\nE: SUBSYSTEM=mem\nL: sub=../../class\nA: sub/x=1\n",
            "goes through the link",
        ),
        (
            "P: /devices/x\nE: SUBSYSTEM=mem\nL: sub=../../class\n\n"
            "P: /devices/x/sub/y\nE: SUBSYSTEM=mem\n",
            "goes through the link",
        ),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nA: v=" + "a" * (MAX_VALUE_BYTES + 1) + "\n", "longer"),
        ("P: /devices/x\nN: x\nE: SUBSYSTEM=mem\nE: MAJOR=99999\nE: MINOR=1\n", "MAJOR"),
        ("P: /devices/x\nE: MAJOR=1\n", "SUBSYSTEM"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nX: what\n", "not a record line"),
        ("E: SUBSYSTEM=mem\n", "starts with a 'P:"),
        (GOOD + "\n" + GOOD, "given twice"),
        ("P: /devices/x\nE: SUBSYSTEM=mem\nE: K=a\0b\n", "NUL"),
    ],
)
def test_a_hostile_record_is_refused_naming_the_line(record: str, named: str) -> None:
    with pytest.raises(RecordError, match=re.escape(named)) as refused:
        parse_record(record.encode(), source="bad.umockdev")
    assert re.match(r"bad\.umockdev( line \d+( \(/sys/devices/[^)]*\))?)?: ", str(refused.value))


def test_a_hostile_record_writes_nothing_outside_the_testbed(tmp_path: Path) -> None:
    """The record a naive loader would follow out of the testbed: a link to a directory
    outside, and a device below that link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    record = tmp_path / "hostile.umockdev"
    record.write_text(
        f"P: /devices/a\nE: SUBSYSTEM=mem\nL: b={'../' * 12}{str(outside).lstrip('/')}\n\n"
        "P: /devices/a/b/c\nN: c\nE: SUBSYSTEM=mem\nE: MAJOR=1\nE: MINOR=1\nA: payload=x\n"
    )
    testbed = tmp_path / "tb"
    built = run(
        "mock-host",
        str(testbed),
        "--from",
        str(record),
        env=environment(),
        module="devplug.testing",
    )
    assert built.returncode == 1
    assert "hostile.umockdev line 3: link b leads out of /sys" in built.stderr
    assert not any(outside.iterdir())
    assert not testbed.exists() or not any(testbed.iterdir())
    scanned = run(
        "scan", "--config", str(REAL_DEVICES_CONFIG), "--replay", str(record), env=environment()
    )
    assert scanned.returncode == 2 and scanned.stdout == ""
    assert "--replay: " in scanned.stderr and "leads out of /sys" in scanned.stderr
    assert not any(outside.iterdir())


def test_a_huge_record_is_refused_before_it_is_read(tmp_path: Path) -> None:
    huge = tmp_path / "huge.umockdev"
    with open(huge, "wb") as handle:  # sparse: costs no disk
        handle.truncate(MAX_RECORD_BYTES + 1)
    with pytest.raises(RecordError, match=r"records above \d+ bytes are refused"):
        read_record(huge)


def test_a_replay_that_cannot_restart_names_the_fix(tmp_path: Path) -> None:
    """A program's own call of devplug.cli.main is never restarted: it is told what to do."""
    record = tmp_path / "x.umockdev"
    record.write_text(GOOD)
    code = (
        "import sys; from devplug.cli import main\n"
        f"sys.exit(main(['scan', '--config', {str(REAL_DEVICES_CONFIG)!r}, '--replay', "
        f"{str(record)!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment(preload=False),
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert "run the command under umockdev-wrapper" in result.stderr


# ---------------------------------------------------------------------------------- the format

# How umockdev-record writes a device (children first, DEVNAME absolute, text attributes
# with their newline escaped, the driver as a link), for a card below its PCI function.
UMOCKDEV_RECORD_STYLE = r"""P: /devices/pci0000:00/0000:00:02.0/drm/card0
N: dri/card0
S: dri/by-path/pci-0000:00:02.0-card
E: DEVNAME=/dev/dri/card0
E: DEVTYPE=drm_minor
E: MAJOR=226
E: MINOR=0
E: SUBSYSTEM=drm
E: DEVLINKS=/dev/dri/by-path/pci-0000:00:02.0-card
A: dev=226:0\n
L: device=../../../0000:00:02.0

P: /devices/pci0000:00/0000:00:02.0
E: DRIVER=i915
E: PCI_ID=8086:56A0
E: PCI_SLOT_NAME=0000:00:02.0
E: SUBSYSTEM=pci
A: class=0x030000\n
A: device=0x56a0\n
L: driver=../../../bus/pci/drivers/i915
A: label=\342\200\234GPU\342\200\235\n
H: config=8680A056
A: numa_node=-1\n
A: vendor=0x8086\n
"""


def test_a_record_in_umockdev_records_style_is_the_host_it_describes(host: UmockdevHost) -> None:
    from devplug.scanners.udev import UdevSource
    from devplug.testing.umockdev import add_recorded

    add_recorded(host, parse_record(UMOCKDEV_RECORD_STYLE.encode()), "style")
    source = UdevSource()
    (card,) = source.devices("drm")
    assert card.device_node == "/dev/dri/card0" and source.node_exists("/dev/dri/card0")
    assert source.node_exists("/dev/dri/by-path/pci-0000:00:02.0-card")
    pci = card.parent("pci")
    assert pci is not None and pci.driver == "i915" and pci.attribute("vendor") == "0x8086"
    assert pci.attribute("label") == "\u201cGPU\u201d"
    assert card.link_basename("device") == "0000:00:02.0"
    with open("/sys/devices/pci0000:00/0000:00:02.0/config", "rb") as config:
        assert config.read() == bytes.fromhex("8680A056")
    with open("/sys/devices/pci0000:00/0000:00:02.0/drm/card0/dev", "rb") as dev:
        assert dev.read() == b"226:0\n"


def test_an_empty_record_is_a_host_without_devices() -> None:
    assert parse_record(b"") == []
    assert format_record([]) == ""


@given(st.binary(max_size=300))
def test_any_attribute_bytes_survive_the_format(value: bytes) -> None:
    assert unescape(escape(value).encode()) == value
    device = RecordedDevice(
        "/sys/devices/virtual/mem/x", {"SUBSYSTEM": "mem"}, attributes={"a": value}
    )
    (back,) = parse_record(format_record([device]).encode())
    assert back.attributes == {"a": value}

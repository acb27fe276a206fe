"""``devplug capture`` and ``devplug scan --replay`` (issue 28.3): a host recorded in umockdev's
record format, identifying values scrubbed, scans the same when replayed: this machine's real
devices and every shipped preset, byte for byte in ``scan -o json``. A hostile record is
refused before it names a file."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from devplug.cli import main
from devplug.cli.identifying import (
    ATTRIBUTE_RULES,
    PROPERTY_RULES,
    is_identifying_attribute,
    is_identifying_property,
)
from devplug.cli.scrub import Scrubber
from devplug.scanners.udev.record import (
    MAX_RECORD_BYTES,
    MAX_VALUE_BYTES,
    RecordedDevice,
    RecordError,
    escape,
    format_record,
    parse_record,
    read_record,
    unescape,
)
from devplug.scanners.udev.snapshot import DeviceSnapshot
from devplug.testing.mockhost import PRESETS, build_mock_host
from devplug.testing.umockdev import UmockdevHost, add_usb_serial

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


# One realistic value for every rule of devplug.cli.identifying, under a name the rule is for
# (udev's builtins and rules, the kernel's sysfs ABI; see each rule's source).
IDENTIFYING_PROPERTIES = [
    ("ID_SERIAL_SHORT", "WD-WCC4N7PL5K2X"),  # ata_id
    ("ID_SCSI_SERIAL", "PDNLH0BRHAL2V1"),  # scsi_id
    ("ID_USB_SERIAL_SHORT", "0001A2B3C4D5"),  # usb_id
    ("MEMORY_DEVICE_0_SERIAL_NUMBER", "36C1A7F2"),  # dmi_memory_id
    ("SERIALNO", "NOWORDBOUNDARY123"),  # a glued name
    ("ID_FS_UUID", "9b2c6e1a-3f4d-4e5b-8c7d-1a2b3c4d5e6f"),  # blkid
    ("MD_UUID", "3f1b2a4c:5d6e4f70:8192a3b4:c5d6e7f8"),  # mdadm
    ("DM_UUID", "LVM-Qm7sZxY1k2L3m4N5o6P7q8R9s0T1u2V3W4x5Y6z7A8b9C0d1E2f3G4h5I6j7K8"),
    ("ID_IB_NODE_GUID", "0002:c903:0010:2e14"),
    ("ID_WWN", "0x5000c500a1b2c3d4"),  # ata_id, scsi_id
    ("ID_WWN_WITH_EXTENSION", "0x600508b1001c4d5e9a1b2c3d4e5f6a7b"),
    ("SCSI_IDENT_LUN_EUI64", "0025385b71b07e3a"),  # sg3_utils
    ("SCSI_IDENT_LUN_NAA_REGEXT", "600508b1001c4d5e9a1b2c3d4e5f6a7c"),
    ("SCSI_IDENT_LUN_T10", "ATA_Samsung_SSD_860_EVO_500GB_S3Z9NB0K123456A"),
    ("ID_SCSI_COMPAT", "SATA_Samsung_SSD_860_S3Z9NB0K654321B"),
    ("ID_NET_NAME_MAC", "enx3c7c3f1ea2b4"),  # net_id
    ("ID_NET_MACADDR", "00:1b:21:aa:bb:cc"),  # a glued name
    ("UNIQ", '"90:89:5f:12:ab:cd"'),  # input uevent
    ("HID_UNIQ", "90:89:5f:12:ab:ce"),  # hid uevent
    ("ID_FS_LABEL", "customer-acme-data"),  # blkid
    ("ID_BUS_PATH_HOSTNAME", "db17.prod.example.com"),
    ("NODENAME", "web-42.prod.example.com"),
    ("MEMORY_DEVICE_0_ASSET_TAG", "IT-ASSET-008123"),  # dmi_memory_id
    ("DM_NAME", "vg_secretcustomer-lv_root"),  # dm rules
    ("MD_NAME", "fileserver7:archive"),  # mdadm: host name and array name
    ("NVME_TRADDR", "nn-0x20000090fa123456:pn-0x10000090fa123456"),  # nvme-fabrics
]
IDENTIFYING_ATTRIBUTES = [
    ("serial", "A50285BI01"),  # usb
    ("serial_number", "SMP-BAT0-12345"),  # power_supply
    ("product_serial", "CZC1234XYZ"),  # dmi
    ("nguid", "e8238fa6-bf53-0001-001b-448b4a3c0f1d"),  # nvme
    ("product_uuid", "4c4c4544-0042-3510-8052-b4c04f4d3532"),  # dmi
    ("node_guid", "0002:c903:0010:2e15"),  # infiniband
    ("dm/uuid", "mpath-3600508b1001c4d5e9a1b2c3d4e5f6a7d"),  # dm
    ("wwid", "naa.5000c500a1b2c3d5"),  # scsi
    ("eui", "00 25 38 5b 71 b0 7e 3b"),  # nvme
    ("subsysnqn", "nqn.2014.08.org.nvmexpress:80868086PHKS7481003Y280AGN  INTEL SSDPED1K375GA"),
    ("hostid", "a2f1c3d4-5e6f-4a7b-8c9d-0e1f2a3b4c5d"),  # nvme-fabrics
    ("address", "3c:7c:3f:1e:a2:b5"),  # net
    ("macaddress", "a4:c3:f0:85:1d:2e"),  # ieee80211
    ("sas_address", "0x5000c500a1b2c3d6"),  # sas
    ("hw_addr", "00aabbccddff"),  # a driver's
    ("phys_switch_id", "0c42a1b2c3d4e5f6"),  # net
    ("port_name", "0x21000024ff3dd1a2"),  # fc_host
    ("initiatorname", "iqn.1994-05.com.redhat:8f3c2a1b9d7e"),  # iscsi
    ("cid", "035344534333324780a1b2c3d401215f"),  # mmc
    ("uniq", "90:89:5f:12:ab:cf"),  # input
    ("node_desc", "web-17.prod.example.com mlx5_0"),  # infiniband
    ("unique_id", "d0010101-0060-7c0e-2303-4e3f2a1b0c9d"),  # thunderbolt
    ("board_asset_tag", "IT-ASSET-004242"),  # dmi
    ("dm/name", "vg_customer-lv_home"),  # dm
    ("key", "4f3c2a1b9d7e8f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a"),  # thunderbolt
]
NOT_IDENTIFYING_PROPERTIES = [
    *("ID_MODEL", "ID_VENDOR", "ID_VENDOR_ID", "ID_MODEL_ID", "ID_REVISION", "ID_PATH"),
    *("ID_PATH_TAG", "ID_BUS", "ID_TYPE", "DEVLINKS", "DEVNAME", "DEVTYPE", "DRIVER", "PCI_ID"),
    *("PCI_SLOT_NAME", "MODALIAS", "INTERFACE", "ID_NET_NAME_PATH", "ID_NET_DRIVER", "TAGS"),
    *("ID_USB_INTERFACES", "MAJOR", "MINOR", "NAME", "PHYS", "ID_FS_TYPE", "NVME_TRTYPE"),
    *("ID_INPUT_KEY", "ID_PART_TABLE_TYPE", "ID_MODEL_FROM_DATABASE", "CURRENT_TAGS"),
]
NOT_IDENTIFYING_ATTRIBUTES = [
    *("vendor", "device", "class", "model", "rev", "numa_node", "addr_len", "addr_assign_type"),
    *("broadcast", "capabilities/key", "mtu", "dev", "size", "queue/rotational", "phys"),
    *("firmware_rev", "name", "manfid", "oemid", "idVendor", "idProduct", "product", "label"),
    *("manufacturer", "phys_port_name", "nsid", "power/control", "driver_override", "modalias"),
]


def test_every_rule_for_identifying_names_has_a_planted_value() -> None:
    for rule in PROPERTY_RULES:
        names = [name for name, _ in IDENTIFYING_PROPERTIES]
        assert any(rule.pattern.search(n.upper()) for n in names), rule.source
    for rule in ATTRIBUTE_RULES:
        names = [name for name, _ in IDENTIFYING_ATTRIBUTES]
        assert any(rule.pattern.fullmatch(n.lower()) for n in names), rule.source


def test_names_that_identify_nothing_are_not_scrubbed() -> None:
    assert [k for k in NOT_IDENTIFYING_PROPERTIES if is_identifying_property(k)] == []
    assert [a for a in NOT_IDENTIFYING_ATTRIBUTES if is_identifying_attribute(a)] == []


def _echoed(
    value: str, fields: Mapping[str, str], attributes: Mapping[str, bytes]
) -> DeviceSnapshot:
    """A disk holding ``value`` in ``fields``/``attributes`` and echoing it where no rule
    looks: glued into a site rule's property (as subsysnqn glues the serial to the vendor
    ids), upper-cased and bare in a by-id link, and as bytes in binary VPD-style data."""
    bare = re.sub(r"[-: ]", "", re.sub(r"^(naa\.|eui\.|0x)", "", value.strip('"')))
    binary = b"\x00\x80\x00" + bytes([len(value)]) + value.encode() + b"\xff\x00"
    if re.fullmatch(r"[0-9a-fA-F]+", bare) and len(bare) % 2 == 0:
        binary += b"\x00\x83\x00\x0c\x01\x03\x00\x08" + bytes.fromhex(bare) + b"\xfe"
    return DeviceSnapshot(
        "/sys/devices/virtual/block/sda",
        {"SUBSYSTEM": "block", **fields, "SITE_DISK_TAG": f"80868086{value}  INTEL"},
        {**attributes, "device/vendor_page": binary},
        {},
        node="sda",
        devlinks=(f"disk/by-id/wwn-{value.upper()}", f"disk/by-id/x-{bare}-part1"),
    )


def _scrubbed(device: DeviceSnapshot, keep: tuple[str, ...] = ()) -> tuple[bytes, RecordedDevice]:
    scrubber = Scrubber(keep)
    scrubber.collect([device])
    scrubbed = scrubber.device(device)
    return format_record([scrubbed]).encode(), scrubbed


@pytest.mark.parametrize(("name", "value"), IDENTIFYING_PROPERTIES)
def test_an_identifying_property_is_scrubbed_wherever_it_is_spelled(name: str, value: str) -> None:
    device = _echoed(value, {name: value}, {})
    record, scrubbed = _scrubbed(device)
    assert_swept(record, [value.strip('"')])
    assert scrubbed.properties[name] not in ("", value)
    # Binary data keeps its layout: each form replaced by as many bytes.
    original = device.attributes["device/vendor_page"]
    assert len(scrubbed.attributes["device/vendor_page"]) == len(original)


@pytest.mark.parametrize(("name", "value"), IDENTIFYING_ATTRIBUTES)
def test_an_identifying_attribute_is_scrubbed_wherever_it_is_spelled(name: str, value: str) -> None:
    raw = f"{value}\n".encode()
    device = _echoed(value, {}, {name: raw})
    record, scrubbed = _scrubbed(device)
    assert_swept(record, [value])
    assert scrubbed.attributes[name] not in (b"\n", raw) and scrubbed.attributes[name].endswith(
        b"\n"
    )
    original = device.attributes["device/vendor_page"]
    assert len(scrubbed.attributes["device/vendor_page"]) == len(original)


def test_a_kept_value_stays_whole_where_another_value_is_inside_it() -> None:
    """A SAS disk's scsi_id serial is ``3`` and its WWN: kept (ids made of ID_SERIAL), it
    stays as it is in every field and link, though the WWN alone is scrubbed elsewhere."""
    serial, wwn = "35000c500a1b2c3d4", "5000c500a1b2c3d4"
    device = DeviceSnapshot(
        "/sys/devices/virtual/block/sdb",
        {"SUBSYSTEM": "block", "ID_SERIAL": serial, "ID_WWN": f"0x{wwn}"},
        {"device/wwid": f"naa.{wwn}\n".encode()},
        {},
        node="sdb",
        devlinks=(f"disk/by-id/scsi-{serial}", f"disk/by-id/wwn-0x{wwn}"),
    )
    _, scrubbed = _scrubbed(device, keep=("ID_SERIAL",))
    assert scrubbed.properties["ID_SERIAL"] == serial
    assert scrubbed.devlinks[0] == f"disk/by-id/scsi-{serial}"
    assert wwn not in scrubbed.properties["ID_WWN"] and wwn not in scrubbed.devlinks[1]
    assert (
        scrubbed.attributes["device/wwid"] == f"naa.{scrubbed.properties['ID_WWN'][2:]}\n".encode()
    )


def test_a_record_that_would_leak_a_value_is_not_written(
    host: UmockdevHost,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The last check before writing: a scrubbing bug (here: nothing replaced) leaks no
    serial; the capture names where the value was found and writes nothing."""
    add_usb_serial(host, index=0, serial=SERIAL)
    monkeypatch.setattr(Scrubber, "text", lambda self, value: value)
    monkeypatch.setattr(Scrubber, "_whole", lambda self, value: value)
    monkeypatch.setattr(Scrubber, "data", lambda self, value: value)
    config = _serial_config(tmp_path)
    output = tmp_path / "leaky.umockdev"
    code = main(["capture", "--config", str(config), "-o", str(output)])
    said = capsys.readouterr().err
    assert code == 1 and not output.exists()
    assert "cannot capture: the record would still hold values found under " in said
    assert "ID_SERIAL_SHORT" in said and "--keep serial" in said
    assert SERIAL not in said


def test_capture_writes_its_file_only(tmp_path: Path) -> None:
    """A symlink planted where a fixed temporary name would be is not followed (the file it
    leads to keeps its contents); the record is a new file with the umask's mode; a record
    whose name is a symlink replaces the link, not what it leads to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    record = tmp_path / "cap.umockdev"
    planted = f"{tmp_path}/.cap.umockdev.devplug-tmp-$$"
    script = (
        f"umask 077; ln -s {victim} {planted}; exec {sys.executable} -m devplug capture "
        f"--config {REAL_DEVICES_CONFIG} -o {record}"
    )
    result = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious\n"
    assert not record.is_symlink() and record.read_text().startswith("P: /devices/")
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    # Nothing left behind but the planted link.
    (left,) = [p for p in tmp_path.iterdir() if p not in (record, victim)]
    assert left.name.startswith(".cap.umockdev.devplug-tmp-") and left.is_symlink()
    linked = tmp_path / "linked.umockdev"
    linked.symlink_to(victim)
    capture(REAL_DEVICES_CONFIG, linked, environment())
    assert victim.read_text() == "precious\n" and not linked.is_symlink()


# A storage server's identities, each where the kernel and udev put it (values realistic,
# made up): NVMe (serial, subsysnqn with the serial glued to the vendor ids, EUI-64 in three
# spellings, a wwid spelling serial and model in hex), SATA behind SCSI (WWN in four
# spellings, VPD pages and INQUIRY data, ATA IDENTIFY data), an SD card (CID holding the
# serial), wired and wireless NICs, a Bluetooth gamepad, DMI.
NVME_SERIAL = "PHKS7481003Y280AGN"
NVME_EUI = "5cd2e4a1b2c3d4e5"
SAMSUNG_SERIAL = "S4EWNX0R123456K"
SAMSUNG_MODEL = "Samsung SSD 970 EVO Plus 1TB"
SATA_SERIAL = "S3Z9NB0K123456A"
SATA_WWN = "5002538e40a1b2c3"
PART_TABLE_UUID = "3f1b2a4c-5d6e-4f70-8192-a3b4c5d6e7f8"
SD_SERIAL = "a1b2c3d4"
SD_CID = "035344534333324780a1b2c3d401215f"
NIC_MAC = "3c:7c:3f:1e:a2:b4"
WIFI_MAC = "a4:c3:f0:85:1d:2e"
PAD_MAC = "90:89:5f:12:ab:cd"
DMI = {
    "product_serial": "CZC1234XYZ",
    "product_uuid": "4c4c4544-0042-3510-8052-b4c04f4d3532",
    "board_serial": ".7XYZ123.CN1296355D0042.",
    "chassis_serial": "7XYZ1234",
    "chassis_asset_tag": "IT-ASSET-004242",
}
PLANTED = [
    NVME_SERIAL,
    NVME_EUI,
    SAMSUNG_SERIAL,
    SATA_SERIAL,
    SATA_WWN,
    PART_TABLE_UUID,
    SD_SERIAL,
    SD_CID,
    NIC_MAC,
    WIFI_MAC,
    PAD_MAC,
    *DMI.values(),
]


def _ata_identify(serial: str, wwn: str) -> str:
    """ata_device's ``id``: the 256 words of IDENTIFY DEVICE, ``%04x`` each, 8 a line; the
    serial in words 10-19, the WWN in words 108-111."""
    words = [0] * 256
    padded = serial.ljust(20).encode()
    for index in range(10):
        words[10 + index] = padded[2 * index] << 8 | padded[2 * index + 1]
    for index in range(4):
        words[108 + index] = int(wwn[4 * index : 4 * index + 4], 16)
    lines = [" ".join(f"{w:04x}" for w in words[i : i + 8]) for i in range(0, 256, 8)]
    return "\\n".join(lines) + "\\n"


def _storage_server_record() -> str:
    vpd_pg80 = b"\x00\x80\x00\x14" + SATA_SERIAL.ljust(20).encode()
    vpd_pg83 = b"\x00\x83\x00\x0c\x01\x03\x00\x08" + bytes.fromhex(SATA_WWN)
    inquiry = (
        b"\x00\x00\x05\x02\x5b\x00\x00\x02ATA     Samsung SSD 860 3B6Q"
        + SATA_SERIAL.ljust(20).encode()
        + bytes(40)
    )
    nvme_wwid = f"nvme.144d-{SAMSUNG_SERIAL.encode().hex()}-{SAMSUNG_MODEL.encode().hex()}-00000001"
    eui_spaced = " ".join(NVME_EUI[i : i + 2] for i in range(0, 16, 2))
    sata = "/devices/pci0000:00/0000:00:17.0/ata1"
    return f"""P: /devices/pci0000:00/0000:00:1d.0
E: SUBSYSTEM=pci
A: vendor=0x8086\\n

P: /devices/pci0000:00/0000:00:1d.0/nvme/nvme0
N: nvme0
E: SUBSYSTEM=nvme
E: DEVNAME=/dev/nvme0
E: MAJOR=240
E: MINOR=0
A: serial={NVME_SERIAL}  \\n
A: model=INTEL SSDPED1K375GA                     \\n
A: subsysnqn=nqn.2014.08.org.nvmexpress:80868086{NVME_SERIAL}  INTEL SSDPED1K375GA\\n

P: /devices/pci0000:00/0000:00:1d.0/nvme/nvme0/nvme0n1
N: nvme0n1
S: disk/by-id/nvme-INTEL_SSDPED1K375GA_{NVME_SERIAL}
S: disk/by-id/nvme-eui.{NVME_EUI}
E: SUBSYSTEM=block
E: DEVTYPE=disk
E: DEVNAME=/dev/nvme0n1
E: MAJOR=259
E: MINOR=0
E: ID_SERIAL=INTEL_SSDPED1K375GA_{NVME_SERIAL}
E: ID_SERIAL_SHORT={NVME_SERIAL}
E: ID_WWN=eui.{NVME_EUI}
A: wwid=eui.{NVME_EUI}\\n
A: eui={eui_spaced}\\n
A: nguid=00000000-0000-0000-0000-000000000000\\n

P: /devices/pci0000:00/0000:00:1c.0
E: SUBSYSTEM=pci
A: vendor=0x144d\\n

P: /devices/pci0000:00/0000:00:1c.0/nvme/nvme1
N: nvme1
E: SUBSYSTEM=nvme
E: DEVNAME=/dev/nvme1
E: MAJOR=240
E: MINOR=1
A: serial={SAMSUNG_SERIAL}     \\n

P: /devices/pci0000:00/0000:00:1c.0/nvme/nvme1/nvme1n1
N: nvme1n1
S: disk/by-id/nvme-{nvme_wwid}
E: SUBSYSTEM=block
E: DEVTYPE=disk
E: DEVNAME=/dev/nvme1n1
E: MAJOR=259
E: MINOR=1
A: wwid={nvme_wwid}\\n

P: /devices/pci0000:00/0000:00:17.0
E: SUBSYSTEM=pci
A: vendor=0x8086\\n

P: {sata}/link1/dev1.0/ata_device/dev1.0
E: SUBSYSTEM=ata_device
A: id={_ata_identify(SATA_SERIAL, SATA_WWN)}
A: xfer_mode=XFER_UDMA_6\\n

P: {sata}/host0/target0:0:0/0:0:0:0
E: SUBSYSTEM=scsi
E: DEVTYPE=scsi_device
A: vendor=ATA     \\n
A: model=Samsung SSD 860 \\n
A: wwid=naa.{SATA_WWN}\\n
H: vpd_pg80={vpd_pg80.hex()}
H: vpd_pg83={vpd_pg83.hex()}
H: inquiry={inquiry.hex()}

P: {sata}/host0/target0:0:0/0:0:0:0/block/sda
N: sda
S: disk/by-id/ata-Samsung_SSD_860_EVO_500GB_{SATA_SERIAL}
S: disk/by-id/wwn-0x{SATA_WWN}
E: SUBSYSTEM=block
E: DEVTYPE=disk
E: DEVNAME=/dev/sda
E: MAJOR=8
E: MINOR=0
E: ID_SERIAL=Samsung_SSD_860_EVO_500GB_{SATA_SERIAL}
E: ID_SERIAL_SHORT={SATA_SERIAL}
E: ID_WWN=0x{SATA_WWN}
E: ID_WWN_WITH_EXTENSION=0x{SATA_WWN}
E: SCSI_IDENT_LUN_NAA_REG={SATA_WWN}
E: SCSI_IDENT_SERIAL={SATA_SERIAL}
E: ID_SCSI_COMPAT=SATA_Samsung_SSD_860_{SATA_SERIAL}
E: ID_PART_TABLE_UUID={PART_TABLE_UUID}

P: /devices/platform/sdhci.0/mmc_host/mmc0/mmc0:aaaa
E: SUBSYSTEM=mmc
A: cid={SD_CID}\\n
A: serial=0x{SD_SERIAL}\\n
A: name=SC32G\\n

P: /devices/pci0000:00/0000:00:1f.6
E: SUBSYSTEM=pci
A: vendor=0x8086\\n

P: /devices/pci0000:00/0000:00:1f.6/net/enp0s31f6
E: SUBSYSTEM=net
E: INTERFACE=enp0s31f6
E: ID_NET_NAME_MAC=enx{NIC_MAC.replace(":", "")}
E: ID_NET_NAME_PATH=enp0s31f6
A: address={NIC_MAC}\\n
A: addr_len=6\\n

P: /devices/pci0000:00/0000:00:14.3
E: SUBSYSTEM=pci
A: vendor=0x8086\\n

P: /devices/pci0000:00/0000:00:14.3/ieee80211/phy0
E: SUBSYSTEM=ieee80211
A: macaddress={WIFI_MAC}\\n
A: addresses={WIFI_MAC}\\n

P: /devices/pci0000:00/0000:00:14.3/net/wlp0s20f3
E: SUBSYSTEM=net
E: INTERFACE=wlp0s20f3
A: address={WIFI_MAC}\\n

P: /devices/virtual/misc/uhid/0005:054C:09CC.0001/input/input20
E: SUBSYSTEM=input
E: NAME="Wireless Controller"
E: PHYS="{WIFI_MAC}"
E: UNIQ="{PAD_MAC}"
A: name=Wireless Controller\\n
A: phys={WIFI_MAC}\\n
A: uniq={PAD_MAC}\\n

P: /devices/virtual/dmi/id
E: SUBSYSTEM=dmi
A: product_name=OptiPlex 7080\\n
""" + "".join(f"A: {name}={value}\\n\n" for name, value in DMI.items())


def _spellings(value: str) -> set[str]:
    """A value, lower-cased, and its bare hex digits when it is a WWN, EUI, MAC address or
    UUID; each also as the hex of its text (how a binary attribute's ``H:`` line shows it)."""
    lower = value.lower()
    forms = {lower}
    bare = re.sub(r"^(naa\.|eui\.|0x)", "", lower)
    if re.fullmatch(r"[0-9a-f]+([-: ][0-9a-f]+)*", bare):
        forms.add(re.sub(r"[-: ]", "", bare))
    return forms | {form.encode().hex() for form in forms}


def assert_swept(record: bytes, planted: list[str]) -> None:
    """No planted value, in any spelling, anywhere in the record (in any case)."""
    text = record.decode().lower()
    for value in planted:
        for form in _spellings(value):
            assert form not in text, f"{value!r} left in the record as {form!r}"


def test_every_identifying_value_of_a_storage_server_is_scrubbed_in_every_spelling(
    short_dir: Path,
) -> None:
    planted_record = short_dir / "planted.umockdev"
    planted_record.write_text(_storage_server_record())
    testbed = short_dir / "tb"
    made = run(
        "mock-host",
        str(testbed),
        "--from",
        str(planted_record),
        env=environment(),
        module="devplug.testing",
    )
    assert made.returncode == 0, made.stderr
    config = short_dir / "all.yaml"  # a devnode-only match: every subsystem is captured
    config.write_text(
        "scanners:\n  generic:\n    - resource: example.com/disk\n"
        "      match: {devnode: /dev/sd*}\n"
    )
    record = short_dir / "scrubbed.umockdev"
    capture(config, record, environment(testbed=testbed))
    data = record.read_bytes()
    assert_swept(data, PLANTED)
    devices = {d.sys_path.removeprefix("/sys"): d for d in parse_record(data)}
    # Binary identity pages and ATA IDENTIFY data are not captured at all.
    scsi = devices["/devices/pci0000:00/0000:00:17.0/ata1/host0/target0:0:0/0:0:0:0"]
    assert not {"vpd_pg80", "vpd_pg83", "inquiry"} & set(scsi.attributes)
    ata = devices["/devices/pci0000:00/0000:00:17.0/ata1/link1/dev1.0/ata_device/dev1.0"]
    assert set(ata.attributes) == {"xfer_mode"}
    # One WWN in four spellings is one placeholder in the same four.
    sda = devices[scsi.sys_path.removeprefix("/sys") + "/block/sda"]
    wwn = sda.properties["SCSI_IDENT_LUN_NAA_REG"]
    assert re.fullmatch(r"[0-9a-f]{16}", wwn) and wwn != SATA_WWN
    assert scsi.attributes["wwid"] == f"naa.{wwn}\n".encode()
    assert sda.properties["ID_WWN"] == sda.properties["ID_WWN_WITH_EXTENSION"] == f"0x{wwn}"
    assert f"disk/by-id/wwn-0x{wwn}" in sda.devlinks
    # The EUI-64 spaced, bare and prefixed.
    nvme0n1 = devices["/devices/pci0000:00/0000:00:1d.0/nvme/nvme0/nvme0n1"]
    eui = nvme0n1.attributes["wwid"].decode().removeprefix("eui.").strip()
    assert nvme0n1.attributes["eui"].decode().replace(" ", "").strip() == eui
    assert nvme0n1.properties["ID_WWN"] == f"eui.{eui}"
    # One MAC address, wherever it is, is one placeholder MAC address.
    phy = devices["/devices/pci0000:00/0000:00:14.3/ieee80211/phy0"]
    wlan = devices["/devices/pci0000:00/0000:00:14.3/net/wlp0s20f3"]
    pad = devices["/devices/virtual/misc/uhid/0005:054C:09CC.0001/input/input20"]
    scrubbed_mac = wlan.attributes["address"].decode().strip()
    assert re.fullmatch(r"02:00:00(:[0-9a-f]{2}){3}", scrubbed_mac)
    assert (
        phy.attributes["macaddress"] == phy.attributes["addresses"] == f"{scrubbed_mac}\n".encode()
    )
    assert pad.attributes["phys"] == f"{scrubbed_mac}\n".encode()
    assert pad.properties["PHYS"] == f'"{scrubbed_mac}"'
    # What identifies nothing stays.
    assert pad.properties["NAME"] == '"Wireless Controller"'
    nvme0 = devices["/devices/pci0000:00/0000:00:1d.0/nvme/nvme0"]
    assert nvme0.attributes["model"] == b"INTEL SSDPED1K375GA                     \n"
    dmi = devices["/devices/virtual/dmi/id"]
    assert dmi.attributes["product_name"] == b"OptiPlex 7080\n"


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

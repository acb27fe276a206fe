"""What identifies a machine or its owner in a capture, for :mod:`.scrub`: udev properties and
sysfs attribute files by name (each rule with where such names come from), and the shapes an
identifying value is written in (a WWN as ``naa.5000c500a1b2c3d4``, ``0x5000C500A1B2C3D4``
and ``5000c500a1b2c3d4``).

The rules are wide on purpose: a name that matches and identifies nothing costs a placeholder
in a bug report; a name that is missed leaks a serial number. ``devplug capture --keep NAME``
is the way out of a rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class NameRule:
    """Names matching ``pattern`` (udev properties: searched in the upper-cased name; sysfs
    attributes: the whole lower-cased name relative to the device's dir) hold identifying
    values; ``source`` says where such names come from."""

    pattern: re.Pattern[str]
    source: str


def _rule(pattern: str, source: str) -> NameRule:
    return NameRule(re.compile(pattern), source)


PROPERTY_RULES: Final = (
    _rule(
        r"SERIAL",
        "udev ata_id, scsi_id, usb_id: ID_SERIAL, ID_SERIAL_SHORT, ID_SCSI_SERIAL, "
        "ID_USB_SERIAL; dmi_memory_id: MEMORY_DEVICE_<n>_SERIAL_NUMBER; sg3_utils: "
        "SCSI_IDENT_SERIAL; glued: SERIALNO, ..._SERIALNUMBER",
    ),
    _rule(
        r"UUID",
        "blkid: ID_FS_UUID, ID_FS_UUID_SUB, ID_PART_TABLE_UUID, ID_PART_ENTRY_UUID; "
        "dm rules: DM_UUID; mdadm rules: MD_UUID",
    ),
    _rule(r"GUID", "InfiniBand and GPT globally unique ids"),
    _rule(
        r"WWN|WWID",
        "udev ata_id, scsi_id: ID_WWN, ID_WWN_WITH_EXTENSION, ID_WWN_VENDOR_EXTENSION",
    ),
    _rule(r"(?:^|_)EUI", "sg3_utils: SCSI_IDENT_LUN_EUI64"),
    _rule(
        r"^SCSI_IDENT_",
        "sg3_utils 55-scsi-sg3_id.rules: the designators of VPD page 0x83 (NAA, EUI-64, the "
        "T10 vendor id with the serial, SCSI name strings) of the LUN, port and target",
    ),
    _rule(r"^ID_SCSI_COMPAT", "sg3_utils: vendor, model and serial (the by-id scsi- link)"),
    _rule(
        r"(?:^|_)MAC(?:_?ADDR(?:ESS)?)?(?:_|$)",
        "udev net_id: ID_NET_NAME_MAC (enx + the address); glued: MACADDR",
    ),
    _rule(r"(?:^|_)UNIQ$", "input and hid uevents: UNIQ, HID_UNIQ (a Bluetooth address)"),
    _rule(r"LABEL", "blkid: ID_FS_LABEL, ID_FS_LABEL_ENC"),
    _rule(r"HOSTNAME|NODENAME", "a machine's name"),
    _rule(r"ASSET_?TAG", "udev dmi_memory_id: MEMORY_DEVICE_<n>_ASSET_TAG"),
    _rule(
        r"^(?:DM_NAME|DM_VG_NAME|DM_LV_NAME|MD_NAME|MD_DEVNAME|ID_PART_ENTRY_NAME)$",
        "names people give: dm and LVM rules (volume groups and volumes), mdadm rules "
        "(MD_NAME holds the host name), blkid (GPT partition names)",
    ),
    _rule(
        r"NQN|TRADDR",
        "nvme-fabrics uevents: NVME_TRADDR, NVME_HOST_TRADDR (the storage network's addresses)",
    ),
)

# An attribute file at any depth below the device's dir (``ports/1/...``), by its own name.
_ANY_DIR: Final = r"(?:.+/)?"
ATTRIBUTE_RULES: Final = (
    _rule(
        rf"{_ANY_DIR}(?:\w*_)?serial\w*",
        "usb, virtio-blk, nvme, mmc: serial; cxl memdev: serial (PCIe DSN); dmi: "
        "product_serial, board_serial, chassis_serial; power_supply: serial_number",
    ),
    _rule(
        rf"{_ANY_DIR}\w*[ug]uid\w*",
        "nvme: uuid, nguid; dmi: product_uuid; infiniband: node_guid, sys_image_guid; dm: dm/uuid",
    ),
    _rule(rf"{_ANY_DIR}\w*(?:wwid|wwn)\w*", "scsi, nvme: wwid"),
    _rule(rf"{_ANY_DIR}(?:\w*_)?eui(?:64)?", "nvme: eui"),
    _rule(
        rf"{_ANY_DIR}\w*nqn",
        "nvme: subsysnqn (vendor ids, then the serial and the model), hostnqn",
    ),
    _rule(rf"{_ANY_DIR}hostid", "nvme-fabrics: hostid"),
    _rule(
        rf"{_ANY_DIR}\w*address(?:es)?",
        "net, bluetooth: address; ieee80211: macaddress, addresses; sas: sas_address; iscsi: "
        "hwaddress, ipaddress, persistent_address; nvme-fabrics: address (traddr=...)",
    ),
    _rule(rf"{_ANY_DIR}(?:\w*_)?(?:mac|hw|perm)_?addr", "drivers' perm_addr, mac_addr, hw_addr"),
    _rule(rf"{_ANY_DIR}phys_(?:port|switch)_id", "net: phys_port_id, phys_switch_id"),
    _rule(
        rf"{_ANY_DIR}(?:permanent_port|port|node|fabric)_name",
        "fc_host, fc_remote_ports: the WWPN and WWNN",
    ),
    _rule(rf"{_ANY_DIR}(?:initiator|target)name", "iscsi: initiatorname, targetname (IQNs)"),
    _rule(rf"{_ANY_DIR}cid", "mmc: cid (the card identification register holds the serial)"),
    _rule(rf"{_ANY_DIR}uniq", "input: uniq (a Bluetooth device's address)"),
    _rule(rf"{_ANY_DIR}node_desc", "infiniband: node_desc (the host name)"),
    _rule(rf"{_ANY_DIR}(?:hostname|unique_id)", "thunderbolt: unique_id"),
    _rule(rf"{_ANY_DIR}\w*asset_?tag", "dmi: board_asset_tag, chassis_asset_tag"),
    _rule(r"dm/name", "dm: the mapped device's name (LVM: volume group and volume)"),
    _rule(r"key", "thunderbolt: key (the secure connect key)"),
)


def is_identifying_property(key: str) -> bool:
    upper = key.upper()
    return any(rule.pattern.search(upper) is not None for rule in PROPERTY_RULES)


def is_identifying_attribute(name: str) -> bool:
    lower = name.lower()
    return any(rule.pattern.fullmatch(lower) is not None for rule in ATTRIBUTE_RULES)


def is_trivial(value: str) -> bool:
    """A value that identifies nothing: fewer than two different letters or digits
    (``0``, ``00:00:00:00:00:00``, ``ff:ff:ff:ff:ff:ff``)."""
    return len({c for c in value.lower() if c.isalnum()}) < 2


def values_of(text: str) -> list[str]:
    """The values an attribute file or property holds: one a line (ieee80211's
    ``addresses``), without the blanks and NULs sysfs pads them with and the quotes of an
    input device's ``UNIQ``."""
    values = (line.strip(' \t\r\n\0"') for line in text.split("\n"))
    return [value for value in values if value]


# ---------------------------------------------------------------------------------- shapes

# Hex digits in groups (``52:54:00:ab:cd:ef``, ``00 25 38 5b``, a UUID), maybe after the
# prefix WWNs and EUIs are written with (``naa.``, ``eui.``, ``0x``; nvme's ``uuid.``).
_HEX_SHAPED: Final = re.compile(
    r"(?P<prefix>(?:naa|eui|uuid)\.|0x)?(?P<body>[0-9a-f]+(?:[-: ][0-9a-f]+)*)", re.IGNORECASE
)
_SEPARATORS: Final = re.compile(r"[-: ]")
# Fewer digits are no WWN, EUI or address: the value is text (a serial ``A1B2``).
MIN_HEX_DIGITS: Final = 8


def hex_digits(value: str) -> str | None:
    """The bare hex digits of a hex-shaped value, lower case (``naa.5000C500A1B2C3D4`` ->
    ``5000c500a1b2c3d4``), or None for text."""
    match = _HEX_SHAPED.fullmatch(value)
    if match is None:
        return None
    digits = _SEPARATORS.sub("", match.group("body"))
    return digits.lower() if len(digits) >= MIN_HEX_DIGITS else None


def reshape(value: str, digits: str) -> str:
    """``value`` (hex-shaped, or bare digits) with its hex digits replaced in order by
    ``digits`` (as many), prefix and separators kept, in ``value``'s case."""
    match = _HEX_SHAPED.fullmatch(value)
    if match is None:
        raise ValueError(f"not hex-shaped: {value!r}")
    prefix, body = match.group("prefix") or "", match.group("body")
    upper = any(c in "ABCDEF" for c in body) and not any(c in "abcdef" for c in body)
    new = iter(digits.upper() if upper else digits.lower())
    reshaped = "".join(c if _SEPARATORS.fullmatch(c) else next(new) for c in body)
    if next(new, None) is not None:
        raise ValueError(f"{value!r} has fewer hex digits than {digits!r}")
    return prefix + reshaped


def placeholder_digits(digits: str, number: int) -> str:
    """The hex digits standing for identity ``number`` in place of ``digits`` (as many): a
    12-digit value (a MAC address) gets a locally administered address, 32 digits (a UUID,
    an NGUID) a version 4 UUID, decimal digits decimal ones."""
    length = len(digits)
    if length == 12:
        return f"020000{number:06x}"[-12:]
    if length == 32:
        return f"00000000000040008000{number:012x}"[-32:]
    if digits.isdecimal():
        return f"{number:0{length}d}"[-length:]
    return f"{number:0{length}x}"[-length:]

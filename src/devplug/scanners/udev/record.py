"""umockdev's record format (what ``umockdev-record`` writes, what ``umockdev-run -d`` loads):
:func:`format_record` writes it, :func:`parse_record` and :func:`read_record` read it, checked.
``devplug capture`` writes a host's snapshot in it; ``scan --replay`` and the testbeds of
:mod:`devplug.testing.umockdev` read it. Standard library only.

One paragraph per device, blank lines between them; each line a tag, ``": "``, a value:

- ``P: /devices/...``: the sysfs path below /sys; first line of a paragraph;
- ``N: name``: the device node below /dev (umockdev-record may add ``=HEX`` contents, which
  are accepted and ignored: nothing here opens a node);
- ``S: name``: a symlink below /dev that leads to the node;
- ``E: KEY=value``: a udev property (``SUBSYSTEM`` is required);
- ``A: name=value``: a text attribute, with GLib's C-style escapes (``\\n``, ``\\\\``,
  ``\\"``, octal ``\\ooo`` for other control and non-ASCII bytes);
- ``H: name=HEX``: a binary attribute (text that is not UTF-8, or holds a NUL);
- ``L: name=target``: a symlink in the device's dir, as ``readlink`` shows it.

A record can come from anyone (a bug report): everything in it is checked before it names a
file. Device paths are below /devices and go through no recorded link; node, devlink,
attribute and link names are relative, with no empty, ``.``, ``..`` or hidden component;
link targets lead to a place below /sys; sizes are bounded. :class:`RecordError` says which
line is wrong and why.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
MAX_DEVICES: Final = 100_000
MAX_LINES_PER_DEVICE: Final = 20_000
MAX_VALUE_BYTES: Final = 64 * 1024  # an attribute or property value, decoded
_PATH_MAX: Final = 4096
_NAME_MAX: Final = 255
_MAX_MAJOR: Final = 4095  # the kernel's MAJOR bits (12) and MINOR bits (20)
_MAX_MINOR: Final = (1 << 20) - 1

_TAG_VALUE: Final = re.compile(rb"([PS]): (.*)")
_TAG_KEY_VALUE: Final = re.compile(rb"([EAHL]): ([^=]+)=(.*)")
_TAG_NODE: Final = re.compile(rb"N: ([^=]+)(?:=([0-9A-Fa-f]*))?")
_HEX: Final = re.compile(rb"(?:[0-9A-Fa-f]{2})*")
_PROPERTY_KEY: Final = re.compile(r"[A-Za-z0-9_.:-]+")
_C_ESCAPES: Final = {
    ord("b"): b"\b",
    ord("f"): b"\f",
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("v"): b"\v",
    ord("\\"): b"\\",
    ord('"'): b'"',
}
_ESCAPED_BYTES: Final = {value[0]: b"\\" + bytes([key]) for key, value in _C_ESCAPES.items()}


class RecordError(ValueError):
    """A record that cannot be loaded; the message names the line (or device) and the fix."""


@dataclass(frozen=True, slots=True)
class RecordedDevice:
    """One device of a record. ``sys_path`` is absolute (``/sys/devices/...``); node and
    devlinks are below /dev (``dri/card0``); ``attributes`` and ``links`` are relative to the
    device's dir."""

    sys_path: str
    properties: Mapping[str, str]
    attributes: Mapping[str, bytes] = field(default_factory=dict)
    links: Mapping[str, str] = field(default_factory=dict)
    node: str | None = None
    devlinks: tuple[str, ...] = ()
    # Line of the ``P:`` line in the file it was read from (0: not read from a file).
    line: int = 0

    @property
    def subsystem(self) -> str:
        return self.properties["SUBSYSTEM"]


# ---------------------------------------------------------------------------------- writing


def format_record(devices: Iterable[RecordedDevice]) -> str:
    """The record of ``devices``, in their order (give parents first: umockdev-run and a
    reader adding devices one by one want them so)."""
    paragraphs = []
    for device in devices:
        if not device.sys_path.startswith("/sys/devices/"):
            raise ValueError(f"not a device path: {device.sys_path!r}")
        lines = [f"P: {device.sys_path.removeprefix('/sys')}"]
        if device.node is not None:
            lines.append(f"N: {device.node}")
        lines += [f"S: {link}" for link in device.devlinks]
        lines += [f"E: {key}={value}" for key, value in device.properties.items()]
        for name in sorted({*device.attributes, *device.links}):
            if name in device.links:
                lines.append(f"L: {name}={device.links[name]}")
            else:
                lines.append(_attribute_line(name, device.attributes[name]))
        for line in lines:
            if "\n" in line or "\0" in line:
                raise ValueError(f"{device.sys_path}: a value holds a newline or NUL: {line!r}")
        paragraphs.append("\n".join(lines) + "\n")
    return "\n".join(paragraphs)


def _attribute_line(name: str, value: bytes) -> str:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        return f"H: {name}={value.hex().upper()}"
    return f"A: {name}={escape(value)}"


def escape(value: bytes) -> str:
    """GLib's ``g_strescape``: the escapes ``A:`` values are written with (ASCII only)."""
    out = []
    for byte in value:
        if byte in _ESCAPED_BYTES:
            out.append(_ESCAPED_BYTES[byte].decode())
        elif byte < 0x20 or byte >= 0x7F:
            out.append(f"\\{byte:03o}")
        else:
            out.append(chr(byte))
    return "".join(out)


def unescape(value: bytes) -> bytes:
    """GLib's ``g_strcompress``: an ``A:`` value's bytes. Raises ValueError on a trailing
    backslash."""
    out = bytearray()
    index = 0
    while index < len(value):
        byte = value[index]
        index += 1
        if byte != 0x5C:  # backslash
            out.append(byte)
            continue
        if index == len(value):
            raise ValueError("a trailing backslash")
        following = value[index]
        if 0x30 <= following <= 0x37:  # octal: up to three digits
            end = index
            while end < len(value) and end - index < 3 and 0x30 <= value[end] <= 0x37:
                end += 1
            out.append(int(value[index:end], 8) & 0xFF)
            index = end
            continue
        out += _C_ESCAPES.get(following, bytes([following]))
        index += 1
    return bytes(out)


# ---------------------------------------------------------------------------------- reading


def read_record(path: Path) -> list[RecordedDevice]:
    """The devices of the record file at ``path``, checked (see :func:`parse_record`).

    Raises RecordError for a file that is not a regular file, is larger than
    MAX_RECORD_BYTES, or does not parse; OSError when it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise RecordError(f"{path}: not a regular file")
        if info.st_size > MAX_RECORD_BYTES:
            raise RecordError(
                f"{path}: {info.st_size} bytes; records above {MAX_RECORD_BYTES} bytes are "
                "refused (capture fewer subsystems)"
            )
        data = handle.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{path}: longer than {MAX_RECORD_BYTES} bytes")
    return parse_record(data, source=str(path))


def parse_record(data: bytes, *, source: str = "record") -> list[RecordedDevice]:
    """The devices of a record, every name and size checked; RecordError names the line."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{source}: longer than {MAX_RECORD_BYTES} bytes")
    devices: list[RecordedDevice] = []
    block: list[tuple[int, bytes]] = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line:
            if len(block) >= MAX_LINES_PER_DEVICE:
                raise RecordError(
                    f"{source} line {number}: more than {MAX_LINES_PER_DEVICE} lines in one device"
                )
            block.append((number, line))
            continue
        if block:
            devices.append(_parse_device(block, source))
            block = []
            if len(devices) > MAX_DEVICES:
                raise RecordError(f"{source} line {number}: more than {MAX_DEVICES} devices")
    if block:
        devices.append(_parse_device(block, source))
    _check_paths(devices, source)
    return devices


class _Device:
    """A device while its lines are read."""

    def __init__(self, sys_path: str, line: int) -> None:
        self.sys_path = sys_path
        self.line = line
        self.properties: dict[str, str] = {}
        self.attributes: dict[str, bytes] = {}
        self.links: dict[str, str] = {}
        self.node: str | None = None
        self.devlinks: list[str] = []


def _parse_device(block: list[tuple[int, bytes]], source: str) -> RecordedDevice:
    number, first = block[0]
    where = f"{source} line {number}"
    match = _TAG_VALUE.fullmatch(first)
    if match is None or match.group(1) != b"P":
        raise RecordError(f"{where}: a device starts with a 'P: /devices/...' line")
    device = _Device(_device_path(_text(match.group(2), where), where), number)
    for number, line in block[1:]:
        _parse_line(device, line, f"{source} line {number}")
    where = f"{source} line {device.line} ({device.sys_path})"
    subsystem = device.properties.get("SUBSYSTEM")
    if subsystem is None:
        raise RecordError(f"{where}: no 'E: SUBSYSTEM=...' line")
    _check_component(subsystem, f"{where}: SUBSYSTEM")
    if device.node is not None:
        _check_node(device, where)
    elif device.devlinks:
        raise RecordError(f"{where}: 'S:' lines need the 'N:' line of the node they lead to")
    return RecordedDevice(
        sys_path=device.sys_path,
        properties=device.properties,
        attributes=device.attributes,
        links=device.links,
        node=device.node,
        devlinks=tuple(device.devlinks),
        line=device.line,
    )


def _parse_line(device: _Device, line: bytes, where: str) -> None:
    if (match := _TAG_KEY_VALUE.fullmatch(line)) is not None:
        tag = match.group(1).decode()
        key = _text(match.group(2), where)
        raw = match.group(3)
        # An A: value's escapes take up to four bytes per byte; the rest are taken as they are.
        if len(raw) > (4 if tag == "A" else 2 if tag == "H" else 1) * MAX_VALUE_BYTES:
            raise RecordError(f"{where}: value longer than {MAX_VALUE_BYTES} bytes")
        if tag == "E":
            _add_property(device, key, _text(raw, where), where)
        elif tag == "L":
            _add_name(device, key, where)
            device.links[key] = _link_target(device.sys_path, key, _text(raw, where), where)
        else:
            _add_name(device, key, where)
            device.attributes[key] = _attribute_value(tag, raw, where)
        return
    if (match := _TAG_NODE.fullmatch(line)) is not None:
        if device.node is not None:
            raise RecordError(f"{where}: a second 'N:' line")
        device.node = _dev_name(_text(match.group(1), where), where)
        return
    if (match := _TAG_VALUE.fullmatch(line)) is not None:
        if match.group(1) == b"P":
            raise RecordError(f"{where}: 'P:' inside a device; separate devices by a blank line")
        link = _dev_name(_text(match.group(2), where), where)
        if link in device.devlinks:
            raise RecordError(f"{where}: devlink {link} given twice")
        device.devlinks.append(link)
        return
    shown = line[:60].decode("utf-8", "replace")
    raise RecordError(
        f"{where}: not a record line ({shown!r}); lines are 'P:', 'N:', 'S:', 'E:', 'A:', "
        "'H:' or 'L:' followed by a space"
    )


def _add_property(device: _Device, key: str, value: str, where: str) -> None:
    if not _PROPERTY_KEY.fullmatch(key):
        raise RecordError(f"{where}: property name {key!r} is not A-Z, 0-9, '_', '.', ':', '-'")
    if key in device.properties:
        raise RecordError(f"{where}: property {key} given twice")
    device.properties[key] = value


def _add_name(device: _Device, name: str, where: str) -> None:
    _check_relative(name, f"{where}: name")
    if name in device.attributes or name in device.links:
        raise RecordError(f"{where}: {name} given twice")
    if name.split("/")[0] in ("uevent", "subsystem"):
        raise RecordError(f"{where}: {name} is made from the 'E:' lines, not recorded")


def _attribute_value(tag: str, raw: bytes, where: str) -> bytes:
    if tag == "H":
        if not _HEX.fullmatch(raw):
            raise RecordError(f"{where}: 'H:' values are pairs of hex digits")
        value = bytes.fromhex(raw.decode())
    else:
        try:
            value = unescape(raw)
        except ValueError as exc:
            raise RecordError(f"{where}: {exc}") from None
    if len(value) > MAX_VALUE_BYTES:
        raise RecordError(f"{where}: value longer than {MAX_VALUE_BYTES} bytes")
    return value


def _check_node(device: _Device, where: str) -> None:
    node = device.node
    devname = device.properties.get("DEVNAME")
    if devname is not None and devname not in (node, f"/dev/{node}"):
        raise RecordError(f"{where}: DEVNAME={devname} is not the 'N:' line's /dev/{node}")
    for key, limit in (("MAJOR", _MAX_MAJOR), ("MINOR", _MAX_MINOR)):
        value = device.properties.get(key)
        if value is None or not value.isascii() or not value.isdigit() or int(value) > limit:
            raise RecordError(
                f"{where}: a device with a node needs 'E: {key}=' with a number from 0 to {limit}"
            )


# ---------------------------------------------------------------------------------- checks


def _text(raw: bytes, where: str) -> str:
    if b"\0" in raw:
        raise RecordError(f"{where}: holds a NUL byte")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"{where}: not UTF-8") from None


def _check_component(name: str, what: str) -> None:
    if not name or name in (".", "..") or "/" in name or len(name.encode()) > _NAME_MAX:
        raise RecordError(f"{what}: {name[:80]!r} is not a file name")


def _check_relative(name: str, what: str) -> None:
    """A relative path of plain names: no empty, '.', '..' or hidden (dot) component."""
    if len(name.encode()) >= _PATH_MAX:
        raise RecordError(f"{what}: longer than {_PATH_MAX - 1} bytes")
    for part in name.split("/"):
        if not part or part.startswith(".") or len(part.encode()) > _NAME_MAX:
            raise RecordError(
                f"{what}: {name[:80]!r} must be a relative path of plain names (no empty, "
                "'.', '..' or hidden component)"
            )


def _device_path(value: str, where: str) -> str:
    if not value.startswith("/devices/"):
        raise RecordError(f"{where}: device paths start with /devices/, got {value[:80]!r}")
    _check_relative(value.removeprefix("/"), f"{where}: device path")
    return "/sys" + value


def _dev_name(value: str, where: str) -> str:
    name = value.removeprefix("/dev/")
    _check_relative(name, f"{where}: name below /dev")
    return name


def _link_target(sys_path: str, name: str, target: str, where: str) -> str:
    """``target`` as a relative link that stays below /sys: leading '..' components, then
    plain names (a '..' after a name could climb out through another link)."""
    if not target or len(target.encode()) >= _PATH_MAX:
        raise RecordError(f"{where}: link {name} has an empty or overlong target")
    link_dir = posixpath.dirname(f"{sys_path}/{name}")
    if target.startswith("/"):
        absolute = posixpath.normpath(target)
        if not absolute.startswith("/sys/") or absolute != target.rstrip("/"):
            raise RecordError(f"{where}: link {name} leads out of /sys: {target[:80]!r}")
        target = posixpath.relpath(absolute, link_dir)
    parts = target.split("/")
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    rest = parts[ups:]
    if not rest or any(not part or part in (".", "..") for part in rest):
        raise RecordError(
            f"{where}: link {name}'s target {target[:80]!r} must be '../' steps then names"
        )
    resolved = posixpath.normpath(posixpath.join(link_dir, target))
    if not resolved.startswith("/sys/"):
        raise RecordError(f"{where}: link {name} leads out of /sys: {target[:80]!r}")
    return target


def _check_paths(devices: list[RecordedDevice], source: str) -> None:
    """No device twice, and nothing written through a link: no device path, attribute or link
    name may pass through a recorded link (or a device's subsystem or driver link)."""
    seen: set[str] = set()
    through: set[str] = set()
    for device in devices:
        if device.sys_path in seen:
            raise RecordError(f"{source} line {device.line}: {device.sys_path} given twice")
        seen.add(device.sys_path)
        through.update(f"{device.sys_path}/{name}" for name in (*device.links, "subsystem"))
    for device in devices:
        where = f"{source} line {device.line} ({device.sys_path})"
        names = [device.sys_path, *(f"{device.sys_path}/{n}" for n in device.attributes)]
        names += [f"{device.sys_path}/{n}" for n in device.links]
        for path in names:
            parts = path.split("/")
            for end in range(4, len(parts)):
                prefix = "/".join(parts[:end])
                if prefix in through:
                    raise RecordError(f"{where}: {path} goes through the link {prefix}")

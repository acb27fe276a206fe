"""The libudev uevent wire format, and sending datagrams to the testbed's event sockets."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Final

_UDEV_MONITOR_MAGIC: Final = 0xFEEDCAFE
_UDEV_HEADER_SIZE: Final = 40
# libudev receives into an 8 KiB buffer; a bigger datagram would be truncated silently.
_MAX_DATAGRAM: Final = 8192


def _string_hash32(text: str) -> int:
    """MurmurHash2 with seed 0, as systemd's string_hash32 (used by monitor BPF filters)."""
    data = text.encode()
    m = 0x5BD1E995
    mask = 0xFFFFFFFF
    h = len(data) & mask
    full = len(data) - len(data) % 4
    for (k,) in struct.iter_unpack("<I", data[:full]):
        k = (k * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    tail = data[full:]
    if tail:
        if len(tail) == 3:
            h ^= tail[2] << 16
        if len(tail) >= 2:
            h ^= tail[1] << 8
        h ^= tail[0]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def _tag_bloom(tags: str) -> int:
    bits = 0
    for tag in filter(None, tags.split(":")):
        h = _string_hash32(tag)
        for shift in (0, 6, 12, 18):
            bits |= 1 << ((h >> shift) & 63)
    return bits


def encode_udev_message(properties: Mapping[str, str]) -> bytes:
    """Encode a libudev monitor datagram, as udevd and umockdev's uevent_sender.c do.

    Header: ``"libudev\\0"``, magic 0xfeedcafe (big-endian), header_size, properties_off,
    properties_len (host order), subsystem hash, devtype hash, tag bloom hi/lo (big-endian);
    then ``KEY=VALUE\\0`` for each property. ACTION, DEVPATH, SUBSYSTEM and a non-zero
    SEQNUM are mandatory for libudev to accept it.
    """
    for key in ("ACTION", "DEVPATH", "SUBSYSTEM", "SEQNUM"):
        if not properties.get(key):
            raise ValueError(f"uevent needs {key}")
    body = b"".join(f"{key}={value}".encode() + b"\0" for key, value in properties.items())
    devtype = properties.get("DEVTYPE")
    bloom = _tag_bloom(properties.get("TAGS", ""))
    header = (
        b"libudev\0"
        + struct.pack(">I", _UDEV_MONITOR_MAGIC)
        + struct.pack("=III", _UDEV_HEADER_SIZE, _UDEV_HEADER_SIZE, len(body))
        + struct.pack(
            ">IIII",
            _string_hash32(properties["SUBSYSTEM"]),
            _string_hash32(devtype) if devtype else 0,
            bloom >> 32,
            bloom & 0xFFFFFFFF,
        )
    )
    message = header + body
    if len(message) > _MAX_DATAGRAM:
        raise ValueError(f"uevent too large for libudev ({len(message)} > {_MAX_DATAGRAM})")
    return message


def _send_all(paths: Sequence[str], datagram: bytes) -> tuple[int, list[str]]:
    """Send without blocking; return (delivered count, sockets whose queue was full)."""
    sent = 0
    full: list[str] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        for path in paths:
            try:
                sock.sendto(datagram, path)
            except BlockingIOError:
                full.append(path)
            except ConnectionRefusedError:
                # The monitor was closed; umockdev's sender also removes the stale socket.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            except FileNotFoundError:
                pass
            else:
                sent += 1
    return sent, full

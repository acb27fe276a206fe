"""Uevents for the testbed's monitors: what an event carries, and sending it to them.

The preload binds every uevent monitor socket at ``<testbed>/event<fd>``; an event is one
libudev datagram (see ``wire.py``) sent to each of them, as umockdev's own sender does. The
host keeps the devices and the SEQNUM counter and calls these helpers from its ``emit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Mapping, Sequence
from typing import Final

from devplug.testing.umockdev.files import _check_property
from devplug.testing.umockdev.wire import _send_all

_ACTIONS: Final = frozenset(
    {"add", "remove", "change", "move", "online", "offline", "bind", "unbind"}
)


class UeventQueueFullError(RuntimeError):
    """A monitor socket's queue is full (the monitor is not being drained)."""

    def __init__(self, sockets: Sequence[str], delivered: int) -> None:
        self.sockets = tuple(sockets)
        self.delivered = delivered
        super().__init__(
            f"uevent monitor socket queue full: {', '.join(self.sockets)} "
            f"(delivered to {delivered} other socket(s)). An undrained monitor holds only "
            "net.unix.max_dgram_qlen + 1 datagrams; read it (loop.add_reader) between "
            "events or use emit_async()"
        )


def _event_sockets(root: str) -> list[str]:
    """The monitor sockets the preload created in the testbed at ``root``, sorted."""
    found: list[str] = []
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith("event") and entry.name[5:].isdigit():
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                        found.append(entry.path)
    return sorted(found)


def _check_action(action: str) -> None:
    if action not in _ACTIONS:
        raise ValueError(f"unknown uevent action: {action!r}")


def _event_properties(
    action: str,
    canonical: str,
    subsystem: str,
    current: Mapping[str, str],
    seqnum: int,
    extra: Mapping[str, str],
) -> dict[str, str]:
    """The event for a device whose uevent file holds ``current``, as udevd would send it."""
    props = {
        "ACTION": action,
        "DEVPATH": canonical[len("/sys") :],
        "SUBSYSTEM": subsystem,
        "SEQNUM": str(seqnum),
    }
    for key, value in current.items():
        if key not in props:
            props[key] = value
    if "DEVNAME" in props and not props["DEVNAME"].startswith("/"):
        props["DEVNAME"] = "/dev/" + props["DEVNAME"]  # udevd sends absolute names
    for key, value in extra.items():
        _check_property(key, value, allow_event_keys=True)
        props[key] = value
    return props


def _send_uevent(sockets: Sequence[str], datagram: bytes) -> int:
    """Send to every socket without blocking; return how many received it.

    Raises UeventQueueFullError if a socket's queue is full (after delivering to the others).
    """
    sent, full = _send_all(sockets, datagram)
    if full:
        raise UeventQueueFullError(full, sent)
    return sent


async def _send_uevent_async(sockets: Sequence[str], datagram: bytes, timeout: float) -> int:
    """Like :func:`_send_uevent`, but waits (asyncio sleeps) while a queue is full."""
    pending = sockets
    delivered = 0
    deadline = time.monotonic() + timeout
    while True:
        sent, pending = _send_all(pending, datagram)
        delivered += sent
        if not pending:
            return delivered
        if time.monotonic() >= deadline:
            raise UeventQueueFullError(pending, delivered)
        # Yield to the loop so the reader callbacks can drain the monitor.
        await asyncio.sleep(0.001)

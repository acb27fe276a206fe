"""The operator's cordon requests, as the control channel carries them (JSON objects).

``{"op": "cordon", "resource": R, "id": I, "reason": T}`` cordons a device the scanners see
(or one cordoned already, which may be away: a new reason replaces the old one); ``{"op":
"uncordon", "resource": R, "id": I}`` lifts a cordon; ``{"op": "list"}`` (``"resource": R``
for one resource) answers the daemon's resources and its cordons, each with whether its
device is there now. A change is written to the state file first, then applied by gating the
scanners' last tree again (no rescan); the answer comes once the kubelet front has that tree,
so when ``devplug cordon`` returns, Allocate already refuses the device.

Every answer has ``ok``; a refusal has ``error``: a bad field named with its rule, an unknown
resource with the resources served, an unknown id with the resource's ids (the first
``MAX_IDS_LISTED``, then how many more), a state file that cannot be written or read.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from devplug.hotplug.cordons import (
    Cordon,
    CordonBook,
    CordonsUnreadable,
    key_problem,
    reason_problem,
)
from devplug.hotplug.loop import ScanLoop
from devplug.model import DeviceTree
from devplug.naming import natural_key

OPS = ("list", "cordon", "uncordon")
# An unknown id's refusal lists this many of the resource's ids (a resource may have 10,000).
MAX_IDS_LISTED = 20


class _Refused(Exception):
    """The request cannot be done: the message is the answer's error."""


def cordon_document(key: tuple[str, str], cordon: Cordon, present: bool) -> dict[str, Any]:
    resource, device_id = key
    return {
        "resource": resource,
        "id": device_id,
        "reason": cordon.reason,
        "since": cordon.since,
        "present": present,
    }


def _listed(names: list[str]) -> str:
    names = sorted(names, key=natural_key)
    shown = ", ".join(names[:MAX_IDS_LISTED])
    more = len(names) - MAX_IDS_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _text(request: dict[str, Any], name: str) -> str:
    value = request.get(name)
    if not isinstance(value, str):
        raise _Refused(f"{name}: a string is required")
    return value


class CordonRequests:
    """Answers the control channel's requests for ``name``'s daemon."""

    def __init__(self, book: CordonBook, loop: ScanLoop, name: str) -> None:
        self.book = book
        self.loop = loop
        self.name = name

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "list":
                return self._list(request)
            if op == "cordon":
                return await self._cordon(request)
            if op == "uncordon":
                return await self._uncordon(request)
            raise _Refused(f"op: one of {', '.join(OPS)}, got {str(op)[:40]!r}")
        except _Refused as refused:
            return {"ok": False, "error": str(refused)}

    def _list(self, request: dict[str, Any]) -> dict[str, Any]:
        scanned = self.loop.scanned
        only = request.get("resource")
        cordons = [
            cordon_document(key, cordon, key[1] in scanned.get(key[0], {}))
            for key, cordon in self.book.items()
            if only is None or key[0] == only
        ]
        return {
            "ok": True,
            "name": self.name,
            "scanned": self.loop.first_scan_done.is_set(),
            "resources": {name: len(devices) for name, devices in sorted(scanned.items())},
            "cordons": cordons,
            "unreadable": self.book.blanket,
            "hold_down_s": self.loop.health.hold_down_s,
        }

    def _key(self, request: dict[str, Any]) -> tuple[str, str]:
        resource, device_id = _text(request, "resource"), _text(request, "id")
        problem = key_problem(resource, device_id)
        if problem is not None:
            raise _Refused(problem)
        if not self.loop.first_scan_done.is_set():
            raise _Refused("the daemon is still scanning; try again in a moment")
        return resource, device_id

    def _check_known(self, scanned: DeviceTree, resource: str, device_id: str) -> None:
        """Refuse an id the scanners do not see and that is not cordoned."""
        if self.book.get(resource, device_id) is not None:
            return
        devices = scanned.get(resource)
        if devices is None:
            served = _listed(list(scanned)) or "none"
            raise _Refused(
                f"{resource}: not a resource of this daemon ({self.name}); it has: {served}"
            )
        if device_id not in devices:
            raise _Refused(
                f"{resource}: no device {device_id!r}; its devices: {_listed(list(devices))}"
            )

    async def _cordon(self, request: dict[str, Any]) -> dict[str, Any]:
        resource, device_id = self._key(request)
        reason = _text(request, "reason")
        problem = reason_problem(reason)
        if problem is not None:
            raise _Refused(f"reason: {problem}")
        self._check_known(self.loop.scanned, resource, device_id)
        cordon = await self._change(self.book.cordon(resource, device_id, reason))
        if cordon is not None:
            await self.loop.regate()
        now = self.book.get(resource, device_id)
        assert now is not None
        present = device_id in self.loop.scanned.get(resource, {})
        return {
            "ok": True,
            "changed": cordon is not None,
            "cordon": cordon_document((resource, device_id), now, present),
        }

    async def _uncordon(self, request: dict[str, Any]) -> dict[str, Any]:
        resource, device_id = self._key(request)
        self._check_known(self.loop.scanned, resource, device_id)
        lifted = await self._change(self.book.uncordon(resource, device_id))
        if lifted is not None:
            await self.loop.regate()
        return {
            "ok": True,
            "changed": lifted is not None,
            "hold_down_s": self.loop.health.hold_down_s,
        }

    async def _change(self, change: Awaitable[Cordon | None]) -> Cordon | None:
        """Await a change of the book; its refusal (the file) as the answer's error."""
        try:
            result = await change
        except CordonsUnreadable as exc:
            raise _Refused(str(exc)) from None
        except OSError as exc:
            raise _Refused(
                f"cannot write {self.book.path} ({exc.strerror or exc}): nothing changed"
            ) from None
        return result

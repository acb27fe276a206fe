"""The operator's cordons: devices taken out of service by hand, and the file that keeps them.

A cordon is a (resource, device id) with a reason and the time it was put. The health gate
(:mod:`.health`) advertises a cordoned device Unhealthy, its reason ``cordoned: <reason>``,
and holds it down like any recovered device once the cordon is lifted; so the kubelet stops
placing pods on it, Allocate refuses it, the DRA pool leaves it out, and a status shows why.

Cordons are kept in a small state file beside the daemon's sockets
(``<kubelet dir>/devplug/<name>.cordons.json``: the kubelet's start-up clean-up of its dir
deletes files there, never directories), written before a change takes effect, atomically and
durably, mode 0600, so that a restart, SIGKILL included, finds every cordon. The file states
its format ``version``; ``since`` is UTC, to the second.

- A cordon outlives its device: a device that vanishes keeps its cordon, and comes back
  cordoned (it is the same hardware: unplugged for repair, rebound to another driver).
- A reload (SIGHUP) keeps the cordons: the running set is the file's, written by the daemon.
  The file is read again only when it could not be read before.
- A file that cannot be read (not JSON, another format version, a wrong field, unreadable)
  says nothing of which devices must stay out of service. Failing open would put every
  cordoned device back into service unnoticed, so the daemon fails closed: every device is
  advertised Unhealthy with a reason naming the file and the fix (fix or remove the file, then
  SIGHUP), and cordon changes are refused until then, so the file is never overwritten with
  less than it held. Pods already running keep their devices.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from devplug._kits.atomic import replace_file
from devplug._kits.problems import error_reason
from devplug.naming import TEMP_PREFIX, device_id_problem, resource_name_problem

log = structlog.get_logger(__name__)

STATE_VERSION = 1
STATE_MODE = 0o600
STATE_SUFFIX = ".cordons.json"
# A reason is one line an operator reads in a table, a log line and an Allocate refusal.
MAX_REASON_CHARS = 200
# Bigger than any file of cordons a node can hold (every id of 10,000 devices, with reasons):
# a file past it is not ours to read into memory.
MAX_STATE_BYTES = 16 * 1024 * 1024

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Cordon:
    reason: str
    since: str  # UTC, ISO 8601 to the second ("2025-01-31T09:30:00Z")


class CordonsUnreadable(Exception):
    """The state file could not be read: the message says why and what to do."""


def reason_problem(reason: str) -> str | None:
    """What is wrong with a cordon's reason, or None."""
    if not reason.strip():
        return "give a reason: it is what status, the logs and Allocate's refusal show"
    if len(reason) > MAX_REASON_CHARS:
        return f"at most {MAX_REASON_CHARS} characters, got {len(reason)}"
    if not reason.isprintable():
        return "printable characters only, on one line (no control characters or line breaks)"
    return None


def key_problem(resource: str, device_id: str) -> str | None:
    """What is wrong with a resource name or a device id, or None."""
    problem = resource_name_problem(resource)
    if problem is not None:
        return f"resource {resource!r}: {problem}"
    problem = device_id_problem(device_id)
    return None if problem is None else f"device id {device_id!r}: {problem}"


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def since_timestamp(since: str) -> float:
    """A cordon's ``since`` in Unix time; one without a UTC offset is UTC (the file's rule),
    not the node's local time."""
    moment = datetime.fromisoformat(since)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def state_bytes(cordons: dict[Key, Cordon]) -> bytes:
    """The file's content: sorted and indented, for an operator to read."""
    by_resource: dict[str, dict[str, dict[str, str]]] = {}
    for (resource, device_id), cordon in sorted(cordons.items()):
        by_resource.setdefault(resource, {})[device_id] = {
            "reason": cordon.reason,
            "since": cordon.since,
        }
    document = {"version": STATE_VERSION, "cordons": by_resource}
    return json.dumps(document, indent=2, ensure_ascii=False).encode() + b"\n"


def parse_state(data: bytes) -> dict[Key, Cordon]:
    """The cordons of a file's content; ValueError naming the field that is wrong."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    version = document.get("version")
    if version != STATE_VERSION:
        raise ValueError(
            f"version: {version!r}, this devplug reads version {STATE_VERSION} (was it written "
            "by a newer devplug?)"
        )
    unknown = sorted(set(document) - {"version", "cordons"})
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    cordons: dict[Key, Cordon] = {}
    for resource, devices in _object(document.get("cordons", {}), "cordons").items():
        for device_id, entry in _object(devices, f"cordons.{resource}").items():
            where = f"cordons.{resource}.{device_id}"
            cordons[(resource, device_id)] = _cordon(entry, where)
            problem = key_problem(resource, device_id)
            if problem is not None:
                raise ValueError(f"{where}: {problem}")
    return cordons


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object")
    return value


def _cordon(entry: Any, where: str) -> Cordon:
    fields = _object(entry, where)
    if set(fields) != {"reason", "since"}:
        raise ValueError(f"{where}: expected the fields 'reason' and 'since', got {sorted(fields)}")
    reason, since = fields["reason"], fields["since"]
    if not isinstance(reason, str):
        raise ValueError(f"{where}.reason: not a string")
    problem = reason_problem(reason)
    if problem is not None:
        raise ValueError(f"{where}.reason: {problem}")
    if not isinstance(since, str):
        raise ValueError(f"{where}.since: not a string")
    try:
        datetime.fromisoformat(since)
    except ValueError:
        raise ValueError(f"{where}.since: {since!r} is not an ISO 8601 time") from None
    return Cordon(reason, since)


def read_state(path: Path) -> dict[Key, Cordon]:
    """The file's cordons (none when it does not exist). Blocking. ValueError or OSError."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return {}
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
    return parse_state(data)


class CordonBook:
    """One daemon's cordons, kept in ``path``. Changes are written (in a worker thread)
    before they take effect: a change the disk refused did not happen."""

    def __init__(self, path: Path, clock: Callable[[], str] = utc_now) -> None:
        self.path = path
        self._clock = clock
        self._cordons: dict[Key, Cordon] = {}
        # Why the file could not be read (then every device is held), or None.
        self.unreadable: str | None = None
        self._lock = asyncio.Lock()
        self.writes = 0

    # The health gate's view (devplug.hotplug.health.CordonView).

    def reason(self, resource: str, device_id: str) -> str | None:
        cordon = self._cordons.get((resource, device_id))
        return None if cordon is None else cordon.reason

    def keys(self) -> Collection[Key]:
        return self._cordons.keys()

    @property
    def blanket(self) -> str | None:
        """Every device's reason to be held while the file cannot be read, or None."""
        if self.unreadable is None:
            return None
        return (
            f"cordons unknown: {self.path} cannot be read ({self.unreadable}); every device is "
            "held until the file is fixed or removed and the daemon reloaded (SIGHUP)"
        )

    def __len__(self) -> int:
        return len(self._cordons)

    def items(self) -> list[tuple[Key, Cordon]]:
        """Every cordon, sorted by resource and device id."""
        return sorted(self._cordons.items())

    def get(self, resource: str, device_id: str) -> Cordon | None:
        return self._cordons.get((resource, device_id))

    def by_resource(self) -> dict[str, tuple[int, float]]:
        """Per resource with cordons: how many, and when the oldest was put (Unix time)."""
        counts: dict[str, tuple[int, float]] = {}
        for (resource, _), cordon in self._cordons.items():
            count, oldest = counts.get(resource, (0, float("inf")))
            counts[resource] = (count + 1, min(oldest, since_timestamp(cordon.since)))
        return counts

    # Reading the file.

    async def load(self) -> None:
        """Read the file at start."""
        async with self._lock:
            await self._read()

    async def reread(self) -> None:
        """A reload: the running cordons are kept; a file that could not be read is read
        again (the operator fixed or removed it)."""
        async with self._lock:
            if self.unreadable is not None:
                await self._read()

    async def _read(self) -> None:
        try:
            cordons = await asyncio.to_thread(read_state, self.path)
        except (OSError, ValueError) as exc:
            reason = f"{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
            fields = {
                "file": str(self.path),
                "reason": reason,
                "effect": "every device advertised Unhealthy; cordon changes refused",
                "fix": "fix or remove the file, then reload (SIGHUP)",
            }
            if self.unreadable is None:
                log.error("cordons.unreadable", **fields)
            else:  # still: the reload that was to fix it did not
                log.warning("cordons.unreadable", **fields)
            self.unreadable = reason
            return
        if self.unreadable is not None:
            log.info("cordons.readable", file=str(self.path))
        self.unreadable = None
        self._cordons = cordons
        if cordons:
            log.info("cordons.loaded", file=str(self.path), cordons=len(cordons))

    # Changing them.

    async def cordon(self, resource: str, device_id: str, reason: str) -> Cordon | None:
        """Cordon a device (a new reason replaces the old one, keeping ``since``); None when
        it was cordoned already with this reason. CordonsUnreadable or OSError: nothing
        changed."""
        async with self._lock:
            self._check_readable()
            key = (resource, device_id)
            old = self._cordons.get(key)
            if old is not None and old.reason == reason:
                return None
            cordon = Cordon(reason, old.since if old is not None else self._clock())
            await self._save({**self._cordons, key: cordon})
            log.warning("device.cordoned", resource=resource, device=device_id, reason=reason)
            return cordon

    async def uncordon(self, resource: str, device_id: str) -> Cordon | None:
        """Lift a cordon; the cordon lifted, None when the device was not cordoned.
        CordonsUnreadable or OSError: nothing changed."""
        async with self._lock:
            self._check_readable()
            key = (resource, device_id)
            old = self._cordons.get(key)
            if old is None:
                return None
            await self._save({k: v for k, v in self._cordons.items() if k != key})
            log.info("device.uncordoned", resource=resource, device=device_id, was=old.reason)
            return old

    async def restore_file(self) -> None:
        """Write the file again if it is gone while cordons are kept (the dir was removed
        and made again: nobody asked for them to be lifted)."""
        async with self._lock:
            if self._cordons and self.unreadable is None and not self.path.exists():
                try:
                    await self._save(dict(self._cordons))
                except OSError as exc:
                    log.error("cordons.write.failed", file=str(self.path), reason=error_reason(exc))
                    return
                log.warning("cordons.file.restored", file=str(self.path), cordons=len(self))

    def _check_readable(self) -> None:
        if self.unreadable is not None:
            raise CordonsUnreadable(self.blanket)

    async def _save(self, cordons: dict[Key, Cordon]) -> None:
        data = state_bytes(cordons)
        write = asyncio.ensure_future(
            asyncio.to_thread(replace_file, self.path, data, STATE_MODE, TEMP_PREFIX)
        )
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # The thread writes whatever happens to the caller: the set must follow the file,
            # and the next write must not be renamed into place before this one.
            await asyncio.wait({write})
            if not write.cancelled() and write.exception() is None:
                self._cordons = cordons
                self.writes += 1
            raise
        self._cordons = cordons
        self.writes += 1

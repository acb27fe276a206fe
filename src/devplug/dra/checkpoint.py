"""The prepared-claims checkpoint: what Prepare answered for each claim, kept on disk.

The kubelet may ask to prepare a claim again (after its own restart) or to unprepare it after
devplug restarted; both must find what was prepared. So every Prepare and Unprepare that
changes the set of prepared claims writes the whole set to ``checkpoint.json`` in the driver's
plugin dir (``<kubelet_root>/plugins/<driver>/``) before it answers: a temporary file in the
same dir, written, fsynced, renamed over the old one, and the dir fsynced, so a crash leaves
the old file or the new one, never a mix. Mode 0600: it names the node's claims and devices.

The file says its format ``version`` and its ``driver``; a file of another version or driver,
or one that does not parse, is a :class:`CheckpointError` naming the file, the field and the
fix rather than a silent fresh start (that would forget which devices are in use). The daemon
reads it at start, before it serves anything, and stops there with that one line (exit status
2, as for a wrong setting): it cannot tell which devices running pods hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pydantic

from devplug._kits.atomic import replace_file
from devplug.errors import ConfigError

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_VERSION = 1
CHECKPOINT_MODE = 0o600
_TEMP_PREFIX = ".checkpoint-tmp-"
# How the file is read: exact types, no unknown fields (a field this release does not know
# means a format it does not know).
_STRICT = pydantic.ConfigDict(strict=True, extra="forbid")


@pydantic.with_config(_STRICT)
@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim: what the kubelet was told (the first five fields) and
    which devplug device it is."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None
    resource: str
    device_id: str
    admin_access: bool


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]


@pydantic.with_config(_STRICT)
@dataclass(frozen=True, slots=True)
class _Record:
    """One claim in the file (its uid is the key)."""

    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


@pydantic.with_config(_STRICT)
@dataclass(frozen=True, slots=True)
class _File:
    version: int
    driver: str
    claims: dict[str, _Record]


_VERSION_ONLY = pydantic.TypeAdapter(dict[str, object], config=pydantic.ConfigDict(strict=True))
_FILE = pydantic.TypeAdapter(_File)


class CheckpointError(ConfigError):
    """The checkpoint cannot be read as this driver's: ``field`` is the file, the message
    names the field in it and the fix."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(str(path), message)


def load_checkpoint(path: Path, driver: str) -> dict[str, PreparedClaim]:
    """The prepared claims in ``path`` by uid ({} when there is no file). Blocking."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the prepared-claims checkpoint: {exc}") from None
    fix = (
        "move the file aside to start with no prepared claims (devplug then no longer knows "
        "which devices running pods hold)"
    )
    try:
        head = _VERSION_ONLY.validate_json(data)
    except pydantic.ValidationError:
        raise CheckpointError(path, f"not a JSON object; {fix}") from None
    version = head.get("version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(
            path,
            f"version: {version!r} is not a checkpoint version this devplug reads "
            f"({CHECKPOINT_VERSION}); was it written by another devplug release? {fix}",
        )
    try:
        parsed = _FILE.validate_json(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(path, f"{where}: {first['msg']}; {fix}") from None
    if parsed.driver != driver:
        raise CheckpointError(
            path,
            f"driver: {parsed.driver!r}, not this daemon's {driver!r}: the file belongs to "
            f"another driver's plugin dir; {fix}",
        )
    return {
        uid: PreparedClaim(record.namespace, record.name, uid, record.devices)
        for uid, record in parsed.claims.items()
    }


def checkpoint_bytes(driver: str, claims: Mapping[str, PreparedClaim]) -> bytes:
    """The file's content for ``claims``: sorted, indented, so that an operator can read it."""
    body = {
        "version": CHECKPOINT_VERSION,
        "driver": driver,
        "claims": {
            uid: {
                "namespace": claim.namespace,
                "name": claim.name,
                "devices": [dataclasses.asdict(device) for device in claim.devices],
            }
            for uid, claim in sorted(claims.items())
        },
    }
    return json.dumps(body, indent=2, sort_keys=True).encode() + b"\n"


def write_checkpoint(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably. Blocking (run it in a thread)."""
    replace_file(path, data, CHECKPOINT_MODE, _TEMP_PREFIX)


class Checkpoint:
    """The checkpoint file of one driver."""

    def __init__(self, path: Path, driver: str) -> None:
        self.path = path
        self.driver = driver
        self.writes = 0

    async def load(self) -> dict[str, PreparedClaim]:
        return await asyncio.to_thread(load_checkpoint, self.path, self.driver)

    async def save(self, claims: Mapping[str, PreparedClaim]) -> None:
        """Write ``claims`` as the whole checkpoint; OSError when the write fails (the old file
        is then left as it was)."""
        data = checkpoint_bytes(self.driver, claims)
        write = asyncio.ensure_future(asyncio.to_thread(write_checkpoint, self.path, data))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # The thread writes on whatever happens to the caller (a kubelet that gave up on
            # the call): it must finish before the caller's lock is let go, or the next
            # write could be renamed into place before this older one.
            await asyncio.wait({write})
            if not write.cancelled():
                write.exception()  # seen: nobody is left to be told
            raise
        self.writes += 1

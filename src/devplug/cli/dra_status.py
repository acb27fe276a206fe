"""``devplug status``'s DRA part: the DRA drivers in the kubelet's plugin registry, and the
claims devplug's driver has prepared.

The kubelet finds a DRA driver through its socket in ``<kubelet root>/plugins_registry`` (the
kubelet root being the parent of the device plugin dir, ``/var/lib/kubelet``). Each socket there
is asked GetInfo, as the kubelet's plugin watcher asks it; an answer of type ``DRAPlugin`` names
the driver and its DRA socket (other types, CSI drivers', are not listed). The claims a devplug
driver has prepared are read from its checkpoint beside its DRA socket, read-only (the daemon
replaces the file whole, so a read never meets half of one); another vendor's driver keeps
its own, so its claims are unknown.

Whether the kubelet accepted a registration is not on disk: the daemon's ``/readyz`` and its
``devplug_dra_registered`` metric say (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from devplug._kits.printable import escaped
from devplug.dra.checkpoint import CHECKPOINT_FILE, CheckpointError, PreparedClaim, load_checkpoint

T = TypeVar("T")

REGISTRY_DIR = "plugins_registry"
DRA_PLUGIN = "DRAPlugin"
REGISTRATION_SUFFIX = "-reg.sock"


@dataclass(frozen=True, slots=True)
class DraDriverStatus:
    """One DRA driver's registration socket, what it answered, and its prepared claims."""

    socket: str  # the registration socket's path
    driver: str  # from GetInfo; from the socket's name when it did not answer
    endpoint: str | None = None  # the DRA socket GetInfo names
    supported_versions: tuple[str, ...] | None = None
    error: str | None = None  # why GetInfo failed
    # The prepared claims by uid; None: unknown (no devplug checkpoint could be read).
    claims: dict[str, PreparedClaim] | None = None
    claims_error: str | None = None

    @property
    def state(self) -> str:
        return "not answering" if self.error is not None else "serving"


def registry_dir(kubelet_dir: Path) -> Path:
    """The kubelet's plugin registry: ``plugins_registry`` in the parent of its device plugin
    dir (both are in its root dir)."""
    return kubelet_dir.absolute().parent / REGISTRY_DIR


def registration_sockets(registry: Path) -> list[Path]:
    """The unix sockets in ``registry`` but hidden names; [] without the dir."""
    found = []
    try:
        with os.scandir(registry) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                try:
                    if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                        found.append(Path(entry.path))
                except OSError:
                    continue
    except FileNotFoundError:
        return []
    return sorted(found)


def read_claims(plugin_dir: Path, driver: str) -> tuple[dict[str, PreparedClaim] | None, str]:
    """The claims in ``driver``'s checkpoint in ``plugin_dir``, or None and why not."""
    path = plugin_dir / CHECKPOINT_FILE
    if not path.exists():
        if (plugin_dir / "dra.sock").exists():
            return {}, ""  # devplug's socket, no checkpoint yet: nothing prepared so far
        return None, f"no devplug checkpoint in {plugin_dir}"
    try:
        return load_checkpoint(path, driver), ""
    except CheckpointError as exc:
        return None, str(exc)


async def probe_driver(socket: Path, timeout: float) -> DraDriverStatus | None:
    """What ``socket`` answers, with the claims its driver prepared; None for a plugin of
    another type (a CSI driver)."""
    from devplug.dra.registration import RegistrationProbeError, ask_registration

    name = socket.name.removesuffix(REGISTRATION_SUFFIX)
    try:
        info = await ask_registration(socket, timeout)
    except RegistrationProbeError as exc:
        if not socket.name.endswith(REGISTRATION_SUFFIX):
            return None  # not a name devplug gives; nothing says it is a DRA driver
        claims, why = await asyncio.to_thread(
            read_claims, socket.parent.parent / "plugins" / name, name
        )
        return DraDriverStatus(str(socket), name, error=str(exc), claims=claims, claims_error=why)
    if info.type != DRA_PLUGIN:
        return None
    claims, why = await asyncio.to_thread(read_claims, Path(info.endpoint).parent, info.driver)
    return DraDriverStatus(
        str(socket),
        info.driver,
        endpoint=info.endpoint,
        supported_versions=info.supported_versions,
        claims=claims,
        claims_error=why or None,
    )


async def beside_dra(
    survey: Awaitable[T], kubelet_dir: Path, timeout: float
) -> tuple[T, list[DraDriverStatus]]:
    """``survey`` (the device plugins'), and the DRA drivers surveyed at the same time."""
    return await asyncio.gather(survey, survey_dra(kubelet_dir, timeout))


async def survey_dra(kubelet_dir: Path, timeout: float) -> list[DraDriverStatus]:
    """Every DRA driver registered (or registering) with the kubelet of ``kubelet_dir``."""
    sockets = registration_sockets(registry_dir(kubelet_dir))
    found = await asyncio.gather(*(probe_driver(socket, timeout) for socket in sockets))
    return [status for status in found if status is not None]


def dra_document(status: DraDriverStatus) -> dict[str, object]:
    claims = status.claims
    return {
        "driver": status.driver,
        "registration_socket": status.socket,
        "endpoint": status.endpoint,
        "supported_versions": None
        if status.supported_versions is None
        else list(status.supported_versions),
        "state": status.state,
        "error": status.error,
        "prepared_claims": None
        if claims is None
        else [
            {
                "namespace": claim.namespace,
                "name": claim.name,
                "uid": uid,
                "devices": [
                    {
                        "resource": device.resource,
                        "id": device.device_id,
                        "device": device.device_name,
                        "cdi_device_ids": list(device.cdi_device_ids),
                    }
                    for device in claim.devices
                ],
            }
            for uid, claim in sorted(claims.items())
        ],
        "claims_error": status.claims_error,
    }


def dra_table(statuses: list[DraDriverStatus]) -> str:
    """One row per DRA driver, then one line per prepared claim."""
    rows = [["DRA DRIVER", "REGISTRATION SOCKET", "PREPARED CLAIMS", "STATUS"]]
    for status in statuses:
        claims = "unknown" if status.claims is None else str(len(status.claims))
        # Escaped: driver names, socket names and errors are any driver's text.
        cells = (status.driver, status.socket, claims, status.error or status.state)
        rows.append([escaped(cell) for cell in cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]])
        for row in rows
    ]
    for status in statuses:
        for claim in sorted((status.claims or {}).values(), key=lambda c: (c.namespace, c.name)):
            devices = ", ".join(f"{d.resource}={d.device_id}" for d in claim.devices)
            line = f"{status.driver}: {claim.namespace}/{claim.name} holds {devices}"
            lines.append(escaped(line))
    return "\n".join(line.rstrip() for line in lines) + "\n"

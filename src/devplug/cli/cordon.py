"""``devplug cordon`` and ``devplug uncordon``: take a device out of service, and put it back,
through the running daemon; and what ``devplug status`` shows of the cordons.

The daemon is found the way ``status`` finds the plugins, in the kubelet dir (``--kubelet-dir``,
else ``$DEVPLUG_KUBELET_DIR``, else the default), whose ``devplug/`` dir holds each daemon's
control socket (:mod:`devplug.ops.control`). Every daemon there is asked which resources it
has; the one with RESOURCE (or with a cordon of it) is asked to change it. Its answer comes once
the kubelet front has the new tree: when ``cordon`` returns, Allocate refuses the device.

Exit status: 0 done, or it was so already; 1 the daemon refused (an unknown resource or id,
its state file it cannot write or read) or no daemon answered; 2 bad usage (a malformed
resource name, id or reason); 130 interrupted.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from devplug._kits.printable import escaped
from devplug.cli.holders import PodsStatus
from devplug.hotplug.cordons import key_problem, reason_problem
from devplug.ops.control import ChannelError, ask, control_dir, control_sockets

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
T = TypeVar("T")


def kubelet_dir_of(given: Path | None) -> tuple[Path, str]:
    """The kubelet dir the command looks in, and where it came from (for messages)."""
    if given is not None:
        return given, "--kubelet-dir"
    from devplug.config import DEFAULT_KUBELET_DIR

    from_env = os.environ.get("DEVPLUG_KUBELET_DIR")
    if from_env:
        return Path(from_env), "DEVPLUG_KUBELET_DIR"
    return Path(DEFAULT_KUBELET_DIR), "the kubelet dir"


@dataclass(frozen=True, slots=True)
class Daemon:
    """A daemon's control socket, and what it answered to ``list`` (or why it did not)."""

    socket: Path
    answer: dict[str, Any] | None
    error: str | None = None

    @property
    def name(self) -> str | None:
        return None if self.answer is None else str(self.answer.get("name"))

    def has(self, resource: str) -> bool:
        if self.answer is None:
            return False
        cordons = self.answer.get("cordons", [])
        return resource in self.answer.get("resources", {}) or any(
            c.get("resource") == resource for c in cordons
        )


async def ask_daemons(
    kubelet_dir: Path, timeout: float, request: dict[str, Any] | None = None
) -> list[Daemon]:
    """Every daemon in ``kubelet_dir`` asked ``request`` (default: ``list``)."""

    async def one(socket: Path) -> Daemon:
        try:
            return Daemon(socket, await ask(socket, request or {"op": "list"}, timeout))
        except ChannelError as exc:
            return Daemon(socket, None, str(exc))

    return list(await asyncio.gather(*(one(s) for s in control_sockets(kubelet_dir))))


def _fail(program: str, message: str) -> int:
    print(f"{program}: {escaped(message)}", file=sys.stderr)
    return EXIT_FAILED


async def _change(
    program: str, kubelet_dir: Path, request: dict[str, Any], timeout: float
) -> tuple[int, dict[str, Any] | None]:
    """Send ``request`` to the daemon with its resource: (exit status, its answer)."""
    resource = request["resource"]
    daemons = await ask_daemons(kubelet_dir, timeout, {"op": "list", "resource": resource})
    if not daemons:
        return _fail(
            program,
            f"no devplug daemon in {kubelet_dir} (no control socket in "
            f"{control_dir(kubelet_dir)}): is it running? --kubelet-dir names another dir",
        ), None
    chosen = next((d for d in daemons if d.has(resource)), None)
    if chosen is None:
        for daemon in daemons:
            if daemon.error is not None:
                _fail(program, daemon.error)
        served = sorted({r for d in daemons if d.answer for r in d.answer.get("resources", {})})
        listed = ", ".join(served[:20]) + (
            f" and {len(served) - 20} more" if len(served) > 20 else ""
        )
        return _fail(
            program, f"{resource}: no daemon here has it; they have: {listed or 'none'}"
        ), None
    try:
        answer = await ask(chosen.socket, request, timeout)
    except ChannelError as exc:
        return _fail(program, str(exc)), None
    if not answer.get("ok"):
        return _fail(program, str(answer.get("error", "refused"))), None
    return EXIT_OK, answer


def _usage(program: str, resource: str, device_id: str, reason: str | None) -> int | None:
    problem = key_problem(resource, device_id)
    if problem is None and reason is not None:
        found = reason_problem(reason)
        problem = None if found is None else f"--reason: {found}"
    if problem is None:
        return None
    print(f"{program}: {escaped(problem)}", file=sys.stderr)
    return EXIT_USAGE


def cordon_command(
    program: str,
    kubelet_dir: Path | None,
    resource: str,
    device_id: str,
    reason: str,
    timeout: float,
) -> int:
    """``devplug cordon RESOURCE ID --reason TEXT``."""
    bad = _usage(program, resource, device_id, reason)
    if bad is not None:
        return bad
    directory, _ = kubelet_dir_of(kubelet_dir)
    request = {"op": "cordon", "resource": resource, "id": device_id, "reason": reason}
    status, answer = asyncio.run(_change(program, directory, request, timeout))
    if answer is None:
        return status
    where = escaped(f"{resource} {device_id}")
    cordon = answer["cordon"]
    if not answer.get("changed"):
        print(f"{where} was cordoned already, since {cordon['since']}: {escaped(reason)}")
    else:
        print(f"cordoned {where}: {escaped(reason)}")
        print("  advertised Unhealthy with this reason; Allocate refuses it; its pods keep it")
    if not cordon.get("present"):
        print("  the device is not there now: it comes back cordoned")
    return EXIT_OK


def uncordon_command(
    program: str, kubelet_dir: Path | None, resource: str, device_id: str, timeout: float
) -> int:
    """``devplug uncordon RESOURCE ID``."""
    bad = _usage(program, resource, device_id, None)
    if bad is not None:
        return bad
    directory, _ = kubelet_dir_of(kubelet_dir)
    request = {"op": "uncordon", "resource": resource, "id": device_id}
    status, answer = asyncio.run(_change(program, directory, request, timeout))
    if answer is None:
        return status
    where = escaped(f"{resource} {device_id}")
    if not answer.get("changed"):
        print(f"{where} was not cordoned")
    else:
        print(
            f"uncordoned {where}: advertised Healthy again once it has been healthy for "
            f"{answer.get('hold_down_s', 0):g}s (the health hold-down)"
        )
    return EXIT_OK


# ---------------------------------------------------------------------- in devplug status

DRAINED = "drained"  # cordoned, and no pod holds it
IN_USE = "in use"  # cordoned, and a pod still holds it
CORDONED = "cordoned"  # cordoned; who holds it is unknown (no --pods, or no pod resources API)


@dataclass(frozen=True, slots=True)
class CordonRow:
    resource: str
    id: str
    reason: str
    since: str
    present: bool  # the device is there now
    holders: tuple[str, ...] | None  # "ns/pod/container"; None: unknown

    @property
    def state(self) -> str:
        if self.holders is None:
            return CORDONED
        return IN_USE if self.holders else DRAINED


async def beside_cordons(
    survey: Awaitable[T], kubelet_dir: Path, timeout: float
) -> tuple[T, list[Daemon]]:
    """``survey`` and every daemon's ``list``, at once."""
    return await asyncio.gather(survey, ask_daemons(kubelet_dir, timeout))


def holders_by_device(holders: PodsStatus | None) -> dict[tuple[str, str], tuple[str, ...]] | None:
    """(resource, id) -> its holders, from ``status --pods``; None when they are unknown."""
    if holders is None or not holders.available:
        return None
    return {
        (row.resource, row.id): tuple(str(h) for h in row.holders or ()) for row in holders.devices
    }


def cordon_rows(
    daemons: Sequence[Daemon], held: dict[tuple[str, str], tuple[str, ...]] | None
) -> list[CordonRow]:
    """Every daemon's cordons, each with its holders (``held``: (resource, id) -> holders, for
    every device; None when who holds what is unknown)."""
    rows = []
    for daemon in daemons:
        for c in (daemon.answer or {}).get("cordons", []):
            key = (str(c["resource"]), str(c["id"]))
            rows.append(
                CordonRow(
                    *key,
                    reason=str(c["reason"]),
                    since=str(c["since"]),
                    present=bool(c["present"]),
                    holders=None if held is None else held.get(key, ()),
                )
            )
    return rows


def cordons_document(rows: Sequence[CordonRow], daemons: Sequence[Daemon]) -> dict[str, Any]:
    return {
        "daemons": [
            {
                "socket": str(d.socket),
                "name": d.name,
                "error": d.error,
                "unreadable": None if d.answer is None else d.answer.get("unreadable"),
            }
            for d in daemons
        ],
        "devices": [
            {
                "resource": r.resource,
                "id": r.id,
                "reason": r.reason,
                "since": r.since,
                "present": r.present,
                "state": r.state,
                "holders": None if r.holders is None else list(r.holders),
            }
            for r in rows
        ],
    }


def cordons_table(
    rows: Sequence[CordonRow], daemons: Sequence[Daemon], *, pods: bool = False
) -> str:
    """The cordoned devices, one a row, and a line per daemon that did not answer or whose
    cordons are unknown; empty when there is nothing to say. Without ``pods`` (``--pods``
    not given) a line says how to tell a drained device from one in use; with it, the pod
    resources line has said already why that is unknown."""
    lines = []
    if rows:
        table = [("CORDONED", "DEVICE", "STATE", "SINCE", "REASON")]
        for r in rows:
            state = (
                r.state
                if r.holders is None or not r.holders
                else f"in use by {', '.join(r.holders)}"
            )
            state += "" if r.present else ", not there"
            table.append(
                (escaped(r.resource), escaped(r.id), escaped(state), r.since, escaped(r.reason))
            )
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        for row in table:
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append("  ".join([*cells, row[4]]).rstrip())
        if not pods and any(r.holders is None for r in rows):
            lines.append("(--pods tells a drained device from one in use)")
    for daemon in daemons:
        if daemon.error is not None:
            lines.append(escaped(f"cordons: unknown, {daemon.error}"))
        elif daemon.answer is not None and daemon.answer.get("unreadable"):
            lines.append(escaped(f"cordons: {daemon.answer['unreadable']}"))
    return "".join(line + "\n" for line in lines)

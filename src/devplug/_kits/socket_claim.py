"""A server's unix socket put at its path without clobbering anyone's socket there.

grpc deletes a unix socket path when a server binds it (even over another process's live
socket) and again when that server stops (even if someone else owns the path by then). So a
server binds a unique temporary name in the same dir (callers give a prefix beginning with
``.``, which the kubelet's plugin watchers ignore), the socket is made 0600 (only root, the
kubelet, may connect), and the temporary name is hard-linked to the real one, which fails
instead of overwriting when the name is taken. A socket file nobody answers on (left by a
killed process) is removed and the link tried again; a live socket or any other file is
refused. grpc's deletions then only ever hit the temporary name, and the real name is removed
by its owner, and only while it is still the same socket (:class:`SocketIdentity`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SOCKET_MODE = 0o600
_TEMP_SUFFIX = ".sock"
_TEMP_RANDOM_BYTES = 6
# Attempts at the link: each failed one removes a stale socket, so more than a few means
# someone keeps making the path again.
_LINK_ATTEMPTS = 3


class SocketInUseError(Exception):
    """The path is taken by a live socket of another process, or by a non-socket file."""


@dataclass(frozen=True, slots=True)
class SocketIdentity:
    """Tells one socket at a path from the next, even when the inode number is reused.

    The modification time, set when the socket is bound: a chmod or chown (a hardening job
    resetting modes) moves the ctime but is no new socket, and must not read as one.
    """

    inode: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> SocketIdentity | None:
        """The identity of the socket at ``path``; None if it is missing or not a socket."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISSOCK(st.st_mode):
            return None
        return cls(st.st_ino, st.st_mtime_ns)


class SocketServer(Protocol):
    """What is used of a server (grpc.aio.Server has it): bind an address, start, stop."""

    def add_insecure_port(self, address: str) -> int: ...

    async def start(self) -> None: ...

    async def stop(self, grace: float | None) -> None: ...


def temporary_name_length(temp_prefix: str) -> int:
    """The length in bytes of the temporary names :func:`listen_at` binds."""
    return len(os.fsencode(temp_prefix)) + 2 * _TEMP_RANDOM_BYTES + len(_TEMP_SUFFIX)


async def listen_at(
    server: SocketServer,
    path: Path,
    *,
    temp_prefix: str,
    in_use_probe_s: float,
    in_use_hint: str = "",
    on_stale_removed: Callable[[], object] | None = None,
) -> SocketIdentity | None:
    """Start ``server`` on the socket ``path``; the identity of the socket put there.

    On any failure the server is stopped and nothing is left in the dir: OSError (the dir is
    missing or not writable, with the kernel's reason), SocketInUseError (``in_use_hint``
    ends the message when a live socket holds the path) or RuntimeError (gRPC refused).
    ``on_stale_removed`` is called when a dead socket at ``path`` was removed to make room.
    """
    temporary = path.parent / f"{temp_prefix}{secrets.token_hex(_TEMP_RANDOM_BYTES)}{_TEMP_SUFFIX}"
    try:
        try:
            server.add_insecure_port(f"unix://{temporary}")
        except RuntimeError:
            raise _bind_failure(temporary) from None
        await server.start()
        os.chmod(temporary, SOCKET_MODE)
        await claim(
            temporary,
            path,
            in_use_probe_s=in_use_probe_s,
            in_use_hint=in_use_hint,
            on_stale_removed=on_stale_removed,
        )
    except BaseException:
        await server.stop(None)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    # Taken once the socket has its name and the temporary one is gone (neither moves the
    # mtime that SocketIdentity uses, so a chmod or a link later does not either).
    return SocketIdentity.of(path)


async def claim(
    temporary: Path,
    path: Path,
    *,
    in_use_probe_s: float,
    in_use_hint: str = "",
    on_stale_removed: Callable[[], object] | None = None,
) -> None:
    """Hard-link the bound socket ``temporary`` to ``path``, replacing only a stale socket
    there; SocketInUseError when ``path`` is taken."""
    for _ in range(_LINK_ATTEMPTS):
        try:
            os.link(temporary, path)
            return
        except FileExistsError:
            await _remove_if_stale(path, in_use_probe_s, in_use_hint, on_stale_removed)
    raise SocketInUseError(f"{path} keeps being re-created by someone else")


def release(path: Path, own: SocketIdentity | None) -> None:
    """Remove the socket at ``path`` if it is still ``own`` (someone else's stays)."""
    if own is not None and SocketIdentity.of(path) == own:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def _remove_if_stale(
    path: Path,
    probe_s: float,
    in_use_hint: str,
    on_stale_removed: Callable[[], object] | None,
) -> None:
    """Delete a socket file nobody answers on; refuse a live socket or any other file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUseError(f"{path} exists and is not a socket; remove it")
    try:
        async with asyncio.timeout(probe_s):
            _, writer = await asyncio.open_unix_connection(path)
    except ConnectionRefusedError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if on_stale_removed is not None:
            on_stale_removed()
        return
    except (OSError, TimeoutError) as exc:
        # Not provably stale (full backlog, permissions): leave it alone.
        raise SocketInUseError(f"{path} is in use or unreachable: {exc}") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    hint = f": {in_use_hint}" if in_use_hint else ""
    raise SocketInUseError(f"another process is serving on {path}{hint}")


def _bind_failure(path: Path) -> Exception:
    """Why ``path`` cannot be bound: gRPC's error names no cause (it goes to grpc-core's own
    stderr line), so a plain bind of the same path asks the kernel (no such dir, permission
    denied, a read-only file system ...)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(os.fspath(path))
    except OSError as exc:
        return OSError(exc.errno, f"cannot create a socket in {path.parent}: {exc.strerror}")
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return RuntimeError(f"gRPC could not listen on {path}")

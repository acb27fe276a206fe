"""A grpc.aio server on one unix socket path, claimed without clobbering anyone's socket.

grpc deletes a unix socket path when a server binds it (even over another process's live
socket) and again when that server stops (even if someone else owns the path by then). So the
server binds a unique temporary name in the same dir, beginning with ``.`` (the kubelet's
plugin watcher ignores such names), and hard-links it to the real name, which fails instead
of overwriting when the name is taken; grpc's deletions then only ever hit the temporary
name, and the real name is removed by us, and only while it is still our socket. The socket
is made 0600 before it gets its real name: only root (the kubelet) may connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from devplug.errors import ConfigError
from devplug.naming import MAX_UNIX_SOCKET_PATH

log = structlog.get_logger("devplug.dra")

SOCKET_MODE = 0o600
TEMP_SOCKET_PREFIX = ".devplug-tmp-"
TEMP_SOCKET_NAME_LENGTH = len(TEMP_SOCKET_PREFIX) + 12 + len(".sock")

# (inode, modification time): tells one socket at a path from the next, even when the inode
# number is reused; a chmod or chown does not change it.
SocketIdentity = tuple[int, int]


class SocketInUseError(Exception):
    """The path is taken by a live socket of another process, or by a non-socket file."""


def socket_identity(path: Path) -> SocketIdentity | None:
    """The identity of the socket at ``path``; None if it is missing or not a socket."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return (st.st_ino, st.st_mtime_ns)


def check_socket_path(path: Path, setting: str) -> Path:
    """``path`` if it and its temporary names fit a unix socket address, else ConfigError
    naming ``setting``."""
    longest = max(
        len(os.fsencode(path)), len(os.fsencode(path.parent)) + 1 + TEMP_SOCKET_NAME_LENGTH
    )
    if longest > MAX_UNIX_SOCKET_PATH:
        raise ConfigError(
            setting,
            f"{path} is too long for a unix socket: a socket path must be at most "
            f"{MAX_UNIX_SOCKET_PATH} bytes; use a shorter directory",
        )
    return path


class SocketServer:
    """A grpc.aio server listening on ``path``; ``add_services`` puts its services on it."""

    def __init__(
        self,
        path: Path,
        add_services: Callable[[grpc.aio.Server], None],
        *,
        stop_grace_s: float = 1.0,
        in_use_probe_s: float = 1.0,
    ) -> None:
        self.path = path
        self.add_services = add_services
        self.stop_grace_s = stop_grace_s
        self.in_use_probe_s = in_use_probe_s
        self._server: grpc.aio.Server | None = None
        self._own: SocketIdentity | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    def intact(self) -> bool:
        """Whether we listen and ``path`` is still our socket (not removed, not replaced)."""
        return self._server is not None and socket_identity(self.path) == self._own

    async def listen(self) -> None:
        """(Re)start listening on ``path``; a server listening before stops first. Raises
        OSError (the dir is missing or not writable), SocketInUseError or RuntimeError."""
        await self.close()
        temporary = self.path.parent / f"{TEMP_SOCKET_PREFIX}{secrets.token_hex(6)}.sock"
        server = grpc.aio.server()
        self.add_services(server)
        try:
            try:
                server.add_insecure_port(f"unix://{temporary}")
            except RuntimeError:
                raise _bind_failure(temporary) from None
            await server.start()
            os.chmod(temporary, SOCKET_MODE)
            await self._claim(temporary)
        except BaseException:
            await server.stop(None)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        self._server = server
        self._own = socket_identity(self.path)

    async def close(self) -> None:
        """Stop serving (in-flight calls get ``stop_grace_s`` to finish) and remove our
        socket, if it is still ours."""
        server, own = self._server, self._own
        self._server = self._own = None
        if server is None:
            return
        try:
            await server.stop(self.stop_grace_s)
        finally:
            if own is not None and socket_identity(self.path) == own:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)

    async def _claim(self, temporary: Path) -> None:
        """Hard-link ``temporary`` to ``path``, replacing only a stale socket there."""
        for _ in range(3):
            try:
                os.link(temporary, self.path)
                return
            except FileExistsError:
                await self._remove_if_stale()
        raise SocketInUseError(f"{self.path} keeps being re-created by someone else")

    async def _remove_if_stale(self) -> None:
        """Delete a socket file nobody answers on; refuse a live socket or any other file."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise SocketInUseError(f"{self.path} exists and is not a socket; remove it")
        try:
            async with asyncio.timeout(self.in_use_probe_s):
                _, writer = await asyncio.open_unix_connection(self.path)
        except ConnectionRefusedError:
            log.info("dra.stale_socket.removed", socket=str(self.path))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        except (OSError, TimeoutError) as exc:
            raise SocketInUseError(f"{self.path} is in use or unreachable: {exc}") from None
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        raise SocketInUseError(
            f"another process is serving on {self.path}: is a second devplug running for "
            "this driver?"
        )


def _bind_failure(path: Path) -> Exception:
    """Why ``path`` cannot be bound: gRPC's error names no cause, so a plain bind of the same
    path asks the kernel (no such dir, permission denied, a read-only file system ...)."""
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

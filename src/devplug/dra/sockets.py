"""The DRA front's grpc.aio servers, each on one unix socket path of the kubelet's.

The socket is put in place by :mod:`devplug._kits.socket_claim` (a temporary name linked to
the real one, never over anyone's live socket, mode 0600), and removed when the server stops,
only while it is still ours.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from devplug._kits.socket_claim import (
    SocketIdentity,
    listen_at,
    release,
    temporary_name_length,
)
from devplug.errors import ConfigError
from devplug.naming import MAX_UNIX_SOCKET_PATH, TEMP_PREFIX

log = structlog.get_logger(__name__)


def check_socket_path(path: Path, setting: str) -> Path:
    """``path`` if it and its temporary names fit a unix socket address, else ConfigError
    naming ``setting``."""
    longest = max(
        len(os.fsencode(path)),
        len(os.fsencode(path.parent)) + 1 + temporary_name_length(TEMP_PREFIX),
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
        return self._server is not None and SocketIdentity.of(self.path) == self._own

    async def listen(self) -> None:
        """(Re)start listening on ``path``; a server listening before stops first. Raises
        OSError (the dir is missing or not writable), SocketInUseError or RuntimeError."""
        await self.close()
        server = grpc.aio.server()
        self.add_services(server)
        own = await listen_at(
            server,
            self.path,
            temp_prefix=TEMP_PREFIX,
            in_use_probe_s=self.in_use_probe_s,
            in_use_hint="is a second devplug running for this driver?",
            on_stale_removed=lambda: log.info("dra.stale_socket.removed", socket=str(self.path)),
        )
        self._server, self._own = server, own

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
            release(self.path, own)

"""One resource's gRPC server: serve on its socket, register, stay registered.

The lifecycle is a loop over observed state rather than a chain of callbacks: on every wake-up
(a change in the kubelet dir, a back-off deadline, or the stat backstop) the server checks
whether its own socket is still the one it bound and whether ``kubelet.sock`` is still the one
it registered with, and does what is missing: re-listen, then re-register.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.daemon.kubelet import (
    KUBELET_SOCKET,
    FileIdentity,
    KubeletDirWatcher,
    RegistrationError,
    register,
)
from devplug.daemon.servicer import DevicePluginServicer
from devplug.daemon.values import LatestValue
from devplug.errors import ConfigError
from devplug.model import DeviceInfo
from devplug.naming import MAX_UNIX_SOCKET_PATH, short_socket_file_name, socket_file_name

log = structlog.get_logger("devplug.server")

SOCKET_MODE = 0o600


@dataclass(frozen=True, slots=True)
class ServerTiming:
    """Timeouts and back-off; tests shorten them, the defaults suit a real node."""

    register_timeout_s: float = 10.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 10.0
    stat_backstop_s: float = 5.0
    drain_timeout_s: float = 1.0
    in_use_probe_s: float = 1.0


DEFAULT_TIMING = ServerTiming()


def socket_path_for(kubelet_dir: Path, resource: str) -> Path:
    """The socket path for ``resource``: readable if it fits a unix socket, else hashed."""
    for name in (socket_file_name(resource), short_socket_file_name(resource)):
        path = kubelet_dir / name
        if len(os.fsencode(path)) <= MAX_UNIX_SOCKET_PATH:
            return path
    raise ConfigError(
        "kubelet_dir",
        f"{kubelet_dir} is too long for unix sockets: a socket path must be at most "
        f"{MAX_UNIX_SOCKET_PATH} bytes; use a shorter directory",
    )


class Backoff:
    """Exponential back-off with jitter, so many servers do not retry in lock-step."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay * random.uniform(0.8, 1.2)


class SocketInUseError(Exception):
    """Another live process serves on our socket path."""


class ResourceServer:
    """Serves one resource and keeps it registered until cancelled."""

    def __init__(
        self,
        resource: str,
        devices: Mapping[str, DeviceInfo],
        hooks: object | None,
        *,
        kubelet_dir: Path,
        watcher: KubeletDirWatcher,
        timing: ServerTiming = DEFAULT_TIMING,
    ) -> None:
        self.resource = resource
        self.kubelet_dir = kubelet_dir
        self.socket_path = socket_path_for(kubelet_dir, resource)
        self.watcher = watcher
        self.timing = timing
        self.devices: LatestValue[Mapping[str, DeviceInfo]] = LatestValue(devices)
        self.servicer = DevicePluginServicer(resource, self.devices, hooks)
        self.registered = asyncio.Event()
        self.registrations = 0
        self._grpc: grpc.aio.Server | None = None
        self._own: FileIdentity | None = None
        self._kubelet: FileIdentity | None = None
        self._log = log.bind(resource=resource, socket=str(self.socket_path))

    def update(self, devices: Mapping[str, DeviceInfo]) -> None:
        """Publish a new device list to every ListAndWatch stream."""
        self.devices.set(devices)

    async def run(self) -> None:
        """Serve and stay registered; returns only by cancellation, cleaning up after itself."""
        listen_backoff = Backoff(self.timing.backoff_initial_s, self.timing.backoff_max_s)
        register_backoff = Backoff(self.timing.backoff_initial_s, self.timing.backoff_max_s)
        retry_at = 0.0
        failed_for: FileIdentity | None = None
        waiting_logged = False
        try:
            while True:
                version = self.watcher.changes.version
                wait = self.timing.stat_backstop_s
                if not self._own_socket_ok():
                    self._set_unregistered()
                    if not self.kubelet_dir.is_dir():
                        # The watcher logs the missing dir once and wakes us when it is back.
                        await self._wait(version, wait)
                        continue
                    try:
                        await self._listen()
                        listen_backoff.reset()
                    except (OSError, RuntimeError, SocketInUseError) as exc:
                        delay = listen_backoff.next()
                        self._log.error("server.listen.failed", error=str(exc), retry_in_s=delay)
                        await self._wait(version, delay)
                        continue
                kubelet = FileIdentity.of(self.kubelet_dir / KUBELET_SOCKET)
                if self._kubelet is not None and kubelet != self._kubelet:
                    self._log.info("kubelet.restart.detected")
                    self._set_unregistered()
                if self._kubelet is None:
                    if kubelet is None:
                        if not waiting_logged:
                            self._log.info("kubelet.waiting", dir=str(self.kubelet_dir))
                            waiting_logged = True
                    elif kubelet != failed_for or time.monotonic() >= retry_at:
                        waiting_logged = False
                        if await self._register(kubelet):
                            register_backoff.reset()
                            failed_for = None
                            continue
                        failed_for = kubelet
                        delay = register_backoff.next()
                        retry_at = time.monotonic() + delay
                        wait = min(wait, delay)
                    else:
                        wait = min(wait, max(retry_at - time.monotonic(), 0.0))
                await self._wait(version, wait)
        finally:
            await self._close()

    async def _wait(self, version: int, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.watcher.changes.wait_changed(version), timeout)

    def _own_socket_ok(self) -> bool:
        return self._grpc is not None and FileIdentity.of(self.socket_path) == self._own

    def _set_unregistered(self) -> None:
        self._kubelet = None
        self.registered.clear()

    async def _listen(self) -> None:
        """(Re)start the gRPC server on our socket; the old one is stopped first.

        grpc unlinks a unix socket's path when its server stops, even if another server has
        bound that path since: stopping the old server after starting the new one would delete
        the new socket.
        """
        await self._stop_grpc()
        await self._clear_stale_socket()
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._grpc = server
        os.chmod(self.socket_path, SOCKET_MODE)
        self._own = FileIdentity.of(self.socket_path)
        self._log.info("server.listening")

    async def _clear_stale_socket(self) -> None:
        """Remove a leftover socket file, unless a live process answers on it."""
        if not os.path.lexists(self.socket_path):
            return
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path), self.timing.in_use_probe_s
            )
        except (OSError, TimeoutError):
            self._log.info("server.stale_socket.removed")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            return
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        raise SocketInUseError(f"another process is serving on {self.socket_path}")

    async def _register(self, kubelet: FileIdentity) -> bool:
        self._log.info("kubelet.register.started")
        started = time.perf_counter()
        try:
            await register(
                self.kubelet_dir,
                endpoint=self.socket_path.name,
                resource=self.resource,
                options=self.servicer.options,
                timeout=self.timing.register_timeout_s,
            )
        except RegistrationError as exc:
            level = self._log.warning if exc.retryable else self._log.error
            level("kubelet.register.failed", error=str(exc))
            return False
        self._kubelet = kubelet
        self.registrations += 1
        self.registered.set()
        self._log.info(
            "kubelet.register.complete", ms=round((time.perf_counter() - started) * 1000, 1)
        )
        return True

    async def retire(self) -> None:
        """Send an empty list (capacity drops at once), let streams drain; then run() may stop."""
        self.devices.set({})
        self.devices.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.idle.wait(), self.timing.drain_timeout_s)

    async def _stop_grpc(self) -> None:
        server, self._grpc = self._grpc, None
        if server is not None:
            await server.stop(None)

    async def _close(self) -> None:
        """Stop serving and remove our socket, if it is still ours."""
        self._set_unregistered()
        own = self._own
        await asyncio.shield(self._stop_grpc())
        if own is not None and FileIdentity.of(self.socket_path) == own:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self._log.info("server.stopped")

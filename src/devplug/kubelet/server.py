"""One resource's gRPC server: serve on its socket, register, stay registered.

The lifecycle is a loop over observed state rather than a chain of callbacks: on every wake-up
(a change in the kubelet dir, a back-off deadline, or the stat backstop) the server checks
whether its own socket is still the one it bound and whether ``kubelet.sock`` is still the one
it registered with, and does what is missing: listen, then register.

The socket is put in place by :mod:`devplug._kits.socket_claim` (a temporary name linked to
the real one, never over anyone's live socket, mode 0600) and removed when the server stops,
only while it is still ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog
from devplug._kits.socket_claim import (
    SocketIdentity,
    SocketInUseError,
    listen_at,
    release,
    temporary_name_length,
)
from devplug._kits.values import LatestValue
from devplug.errors import ConfigError
from devplug.kubelet.handlers import add_to_server
from devplug.kubelet.registration import (
    KUBELET_SOCKET,
    KubeletDirWatcher,
    RegistrationError,
    register,
)
from devplug.kubelet.seams import AnswerExtension, NoServingEvents, ServingEvents
from devplug.kubelet.servicer import DevicePluginServicer
from devplug.kubelet.waiting import KubeletWait
from devplug.model import DeviceInfo, MapEdit
from devplug.naming import (
    MAX_UNIX_SOCKET_PATH,
    TEMP_PREFIX,
    short_socket_file_name,
    socket_file_name,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ServerTiming:
    """Timeouts and back-off; tests shorten them, the defaults suit a real node."""

    register_timeout_s: float = 10.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 10.0
    # inotify wakes servers on kubelet restarts; this only backs it up, so it is rare.
    stat_backstop_s: float = 60.0
    drain_timeout_s: float = 1.0
    in_use_probe_s: float = 1.0
    # Scanners' start/stop hooks (kubelet.lifecycle): the longest a hook may run, and the
    # back-off between start attempts (slower than Register's: a start may load firmware).
    hook_timeout_s: float = 60.0
    start_retry_initial_s: float = 1.0
    start_retry_max_s: float = 60.0
    # While no kubelet is there, ``kubelet.waiting`` is said again after this long, then at
    # doubling intervals up to the maximum: a log read hours later still shows the wait.
    waiting_reminder_initial_s: float = 60.0
    waiting_reminder_max_s: float = 900.0


DEFAULT_TIMING = ServerTiming()


def socket_path_for(kubelet_dir: Path, resource: str) -> Path:
    """The socket path for ``resource``: readable if it fits a unix socket, else hashed."""
    for name in (socket_file_name(resource), short_socket_file_name(resource)):
        path = kubelet_dir / name
        longest = max(len(os.fsencode(name)), temporary_name_length(TEMP_PREFIX))
        if len(os.fsencode(kubelet_dir)) + 1 + longest <= MAX_UNIX_SOCKET_PATH:
            return path
    raise ConfigError(
        "kubelet_dir",
        f"{kubelet_dir} is too long for unix sockets: a socket path must be at most "
        f"{MAX_UNIX_SOCKET_PATH} bytes; use a shorter directory",
    )


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
        extension: AnswerExtension | None = None,
        events: ServingEvents | None = None,
    ) -> None:
        self.resource = resource
        self.events = events if events is not None else NoServingEvents()
        self.kubelet_dir = kubelet_dir
        self.socket_path = socket_path_for(kubelet_dir, resource)
        self.watcher = watcher
        self.timing = timing
        self.devices: LatestValue[Mapping[str, DeviceInfo]] = LatestValue(devices)
        self.servicer = DevicePluginServicer(resource, self.devices, hooks, extension, self.events)
        self.registered = asyncio.Event()
        self.registrations = 0
        self._grpc: grpc.aio.Server | None = None
        self._own: SocketIdentity | None = None
        # True once the current listener was offered to the kubelet in a Register call.
        self._offered = False
        self._kubelet: SocketIdentity | None = None
        self._log = log.bind(resource=resource, socket=str(self.socket_path))

    @property
    def hooks(self) -> object | None:
        return self.servicer.hooks

    def rebind(self, hooks: object | None) -> None:
        """Serve with another scanner's hooks (a reload replaced it). When the options the
        kubelet learned at registration change (PreStartContainer required, say), register
        again so that it learns the new ones."""
        before = self.servicer.options
        self.servicer.bind(hooks)
        again = self.servicer.options != before and self._kubelet is not None
        self._log.info("server.hooks.rebound", reregister=again)
        if again:
            self._set_unregistered()
            self.watcher.poke()

    def update(self, devices: Mapping[str, DeviceInfo], edit: MapEdit | None = None) -> None:
        """Publish a new device list to every ListAndWatch stream; ``edit``: how it was made
        from the list published before (``DeviceTree.edit_since``), if known."""
        if edit is not None:
            self.servicer.edited(devices, edit)
        self.devices.set(devices)

    async def run(self) -> None:
        """Serve and stay registered; returns only by cancellation, cleaning up after itself."""
        backoff = Backoff(self.timing.backoff_initial_s, self.timing.backoff_max_s)
        retry_at = 0.0
        failed_for: SocketIdentity | None = None
        waiting = KubeletWait(
            self.timing.waiting_reminder_initial_s, self.timing.waiting_reminder_max_s
        )
        listen_problem = ProblemLog()
        try:
            while True:
                version = self.watcher.changes.version
                wait = self.timing.stat_backstop_s
                kubelet = SocketIdentity.of(self.kubelet_dir / KUBELET_SOCKET)
                if self._kubelet is not None:
                    if not self._own_socket_ok():
                        self._log.info("kubelet.restart.detected", reason="own socket removed")
                        self._count_restart()
                        self._set_unregistered()
                    elif kubelet != self._kubelet:
                        self._log.info("kubelet.restart.detected", reason="kubelet.sock replaced")
                        self._count_restart()
                        self._set_unregistered()
                if self._kubelet is None:
                    if kubelet is None:
                        # (A missing dir is logged once by the watcher, which wakes us when it
                        # is back; the reminders cover both.)
                        reason = "no kubelet.sock" if self.kubelet_dir.is_dir() else "dir missing"
                        wait = min(wait, waiting.note(self._log, reason, str(self.kubelet_dir)))
                    elif kubelet == failed_for and time.monotonic() < retry_at:
                        wait = min(wait, retry_at - time.monotonic())
                    else:
                        waiting.over()
                        try:
                            await self._ensure_fresh_listener()
                        except (OSError, RuntimeError, SocketInUseError) as exc:
                            delay = backoff.next()
                            listen_problem.report(
                                self._log,
                                "server.listen.failed",
                                str(exc),
                                field="error",
                                retry_in_s=round(delay, 3),
                            )
                            failed_for, retry_at = kubelet, time.monotonic() + delay
                            await self._wait(version, delay)
                            continue
                        listen_problem.solved()
                        if await self._register(kubelet, waiting.waited_s):
                            waiting.said()
                            backoff.reset()
                            failed_for = None
                            continue
                        delay = backoff.next()
                        failed_for, retry_at = kubelet, time.monotonic() + delay
                        wait = min(wait, delay)
                await self._wait(version, wait)
        finally:
            await self._close()

    async def _wait(self, version: int, timeout: float) -> None:
        """Sleep until the kubelet dir changes or ``timeout`` passes.

        asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        arrives as the inner wait completes, which would leave a stopped server running.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await self.watcher.changes.wait_changed(version)

    def _own_socket_ok(self) -> bool:
        return self._grpc is not None and SocketIdentity.of(self.socket_path) == self._own

    def _count_restart(self) -> None:
        self.events.kubelet_restarted(self.resource)

    def _set_unregistered(self) -> None:
        self._kubelet = None
        self.registered.clear()

    async def _ensure_fresh_listener(self) -> None:
        """Listen on our socket with a listener the kubelet has not been offered yet.

        A re-registration on a listener the kubelet already knows would leave its previous
        ListAndWatch stream open; when that stream later ends, current kubelets drop the
        resource's newest client. Restarting the listener ends old streams first.
        """
        if self._grpc is None or self._offered or not self._own_socket_ok():
            await self._listen()

    async def _listen(self) -> None:
        """Start a gRPC server and link its socket into place; the old server stops first."""
        await self._stop_grpc()
        server = grpc.aio.server()
        add_to_server(self.servicer, server)
        own = await listen_at(
            server,
            self.socket_path,
            temp_prefix=TEMP_PREFIX,
            in_use_probe_s=self.timing.in_use_probe_s,
            on_stale_removed=lambda: self._log.info("server.stale_socket.removed"),
        )
        self._grpc = server
        self._offered = False
        self._own = own
        self._log.info("server.listening")

    async def _register(self, kubelet: SocketIdentity, waited_s: float | None) -> bool:
        """Register with the kubelet at ``kubelet``; ``waited_s``: how long this server had
        waited for it to appear (None: it did not), said once registration is complete."""
        self._log.info("kubelet.register.started")
        self._offered = True
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
            self.events.registered(self.resource, ok=False)
            return False
        self._kubelet = kubelet
        self.registrations += 1
        self.registered.set()
        self.events.registered(self.resource, ok=True)
        waited = {} if waited_s is None else {"waited_s": round(waited_s, 1)}
        self._log.info(
            "kubelet.register.complete",
            ms=round((time.perf_counter() - started) * 1000, 1),
            **waited,
        )
        return True

    async def retire(self) -> None:
        """Send an empty list (capacity drops at once), let streams drain; then run() may stop."""
        self.devices.set({})
        self.devices.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timing.drain_timeout_s):
                await self.servicer.idle.wait()

    async def _stop_grpc(self) -> None:
        server, self._grpc = self._grpc, None
        if server is not None:
            await server.stop(None)

    async def _close(self) -> None:
        """Stop serving and remove our socket, if it is still ours."""
        self._set_unregistered()
        own = self._own
        try:
            await self._stop_grpc()
        finally:
            self.servicer.answer_log.flush()  # after the last Allocate gRPC serves
            self.servicer.refusal_log.flush()  # the count of refusals not logged yet
        release(self.socket_path, own)
        self._log.info("server.stopped")

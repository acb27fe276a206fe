"""The systemd notify protocol (``Type=notify``), spoken without libsystemd.

systemd passes ``NOTIFY_SOCKET`` (a unix datagram socket; ``@`` means the abstract namespace)
and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). Each message is one
datagram of ``KEY=VALUE`` lines. devplug sends ``READY=1`` once its first scan is done and
it serves, whether or not a kubelet is there (the daemon's ``_announce_ready``), ``STATUS=``
lines that follow registration ("waiting for the kubelet", "all registered"), ``WATCHDOG=1``
at half the watchdog period from the event loop (so a stuck loop gets the service
restarted), and ``STOPPING=1`` when it shuts down. Outside systemd all of this is a no-op.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import deque
from collections.abc import Mapping

import structlog

from devplug._kits.problems import ProblemLog, error_reason

log = structlog.get_logger(__name__)


SENT_KEPT = 64


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address if address.startswith(("/", "\0")) else ""
        self._socket: socket.socket | None = None
        # A failure is logged when it begins or changes, not on every watchdog ping.
        self._failure = ProblemLog()
        self.watchdog_s = _watchdog_period(environ)
        # The last messages sent, for tests and status (bounded: a watchdog ping goes every
        # few seconds for the daemon's whole life).
        self.sent: deque[str] = deque(maxlen=SENT_KEPT)

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *lines: str) -> None:
        """Send one message; a failure is logged once until a message gets through again, and
        never raised (systemd may be gone during shutdown, and readiness is not worth crashing
        for)."""
        if not self._address:
            return
        message = "\n".join(lines)
        try:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                )
                self._socket.setblocking(False)
            self._socket.sendto(message.encode(), self._address)
        except OSError as exc:
            self._failure.report(log, "systemd.notify.failed", error_reason(exc), level="warning")
            return
        self._failure.solved()
        self.sent.append(message)

    async def watchdog(self) -> None:
        """Ping the watchdog at half its period, for as long as the event loop runs."""
        if self.watchdog_s is None or not self._address:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _watchdog_period(environ: Mapping[str, str]) -> float | None:
    """The watchdog period in seconds, if systemd set one for this very process."""
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (a parent that exec'd us without it)
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None

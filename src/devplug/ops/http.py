"""A small HTTP endpoint on the event loop: ``/metrics``, ``/healthz``, ``/readyz``.

prometheus_client's own server runs in threads; devplug keeps to one event loop, so this
serves GET and HEAD of three fixed paths with asyncio streams. ``/healthz`` answers when the
loop does (the handler runs on it); ``/readyz`` is 200 once every advertised resource is
registered with the kubelet, 503 with the missing ones otherwise.

The port is unauthenticated, so no client may starve the daemon through it: at most
``MAX_CONNECTIONS`` connections are served at once (the rest are closed as soon as they are
accepted, so each costs a file descriptor only for that moment), and each connection, reading
and writing included, is cut after ``CONNECTION_TIMEOUT_S``. The listen backlog equals the cap:
more connections wait in the kernel (costing the daemon nothing), and the descriptors open
in the daemon stay a small multiple of the cap however many clients connect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from devplug._kits.problems import ProblemLog

log = structlog.get_logger("devplug.http")

MAX_HEADER_BYTES = 8192
# A scrape or a probe takes milliseconds; a client holding a connection longer is idle or
# hostile. The whole exchange (request, answer, close) must fit in this.
CONNECTION_TIMEOUT_S = 5.0
# Prometheus and the kubelet's probes open one connection each at a time.
MAX_CONNECTIONS = 32


class StatusEndpoint:
    def __init__(
        self,
        host: str,
        port: int,
        metrics: Callable[[], bytes],
        not_ready: Callable[[], list[str]],
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        self.host, self.port = host, port
        self._metrics = metrics
        self._not_ready = not_ready
        self._server: asyncio.Server | None = None
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.active = 0  # connections being served now
        self.refused = 0  # connections closed at once because ``max_connections`` were open
        self._capped = ProblemLog()

    async def start(self) -> None:
        # The backlog is also how many connections asyncio accepts per loop pass, before any
        # handler has run: kept at the cap, the descriptors open at once stay a small multiple
        # of it (a batch being served, a batch being closed, a batch just accepted).
        self._server = await asyncio.start_server(
            self._handle,
            self.host,
            self.port,
            limit=MAX_HEADER_BYTES,
            backlog=self.max_connections,
        )
        sockets = self._server.sockets
        if sockets and self.port == 0:
            self.port = sockets[0].getsockname()[1]  # the one the OS chose (tests)
        log.info("http.listening", address=f"{self.host}:{self.port}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= self.max_connections:
            self.refused += 1
            self._capped.report(
                log,
                "http.connections.capped",
                f"{self.max_connections} connections open",
                level="warning",
                field="state",
                consequence="new connections are closed until some end",
            )
            writer.transport.abort()
            return
        if self._capped.solved():
            log.info("http.connections.below_cap", refused=self.refused)
        self.active += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                request = await reader.readuntil(b"\r\n\r\n")
                method, path = _request_line(request)
                status, content_type, body = self._answer(method, path)
                head = (
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()
                writer.write(head if method == "HEAD" else head + body)
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (
            TimeoutError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            # A client that sends nothing sensible, or does not read, gets nothing more; abort
            # drops whatever is still buffered for it at once.
            writer.transport.abort()
        finally:
            self.active -= 1

    def _answer(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain; charset=utf-8", b"GET or HEAD only\n"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self._metrics()
        if path == "/healthz":
            return "200 OK", "text/plain; charset=utf-8", b"ok\n"
        if path == "/readyz":
            missing = self._not_ready()
            if not missing:
                return "200 OK", "text/plain; charset=utf-8", b"ready\n"
            text = "not ready: " + ", ".join(missing) + "\n"
            return "503 Service Unavailable", "text/plain; charset=utf-8", text.encode()
        return "404 Not Found", "text/plain; charset=utf-8", b"/metrics, /healthz or /readyz\n"


def _request_line(request: bytes) -> tuple[str, str]:
    first = request.split(b"\r\n", 1)[0].decode("latin-1")
    parts = first.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1]

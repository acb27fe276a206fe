"""A small HTTP endpoint on the event loop: ``/metrics``, ``/healthz``, ``/readyz``.

prometheus_client's own server runs in threads; devplug keeps to one event loop, so this
serves GET and HEAD of three fixed paths with asyncio streams. ``/healthz`` answers when the
loop does (the handler runs on it); ``/readyz`` is 200 once every advertised resource is
registered with the kubelet, 503 with the missing ones otherwise.

The port is unauthenticated, so no client may starve the daemon through it: at most
``MAX_CONNECTIONS`` connections are served at once, each cut after ``CONNECTION_TIMEOUT_S``,
reading and writing included. Connections are accepted one at a time, and one that finds
every slot taken is closed at once, before the next is accepted; the others wait in the
kernel's listen backlog. So the descriptors the endpoint holds never exceed the cap plus the
listening socket and one being closed, however many clients connect and however busy the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import structlog

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
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.active = 0  # connections being served now
        self.refused = 0  # connections closed at once because ``max_connections`` were open
        self._capped = ProblemLog()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (
            await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(self.max_connections)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        if self.port == 0:
            self.port = listener.getsockname()[1]  # the one the OS chose (tests)
        self._accepting = asyncio.create_task(self._accept_loop(), name="http-accept")
        log.info("http.listening", address=f"{self.host}:{self.port}")

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        for task in list(self._serving):
            task.cancel()
        if self._serving:
            await asyncio.gather(*self._serving, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _accept_loop(self) -> None:
        """Accept one connection at a time: serve it if a slot is free, else close it at once,
        here, before the next accept (so a closed one holds its fd for microseconds, and a
        busy loop never piles up accepted connections waiting for a handler)."""
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and the like: try again shortly
                log.warning("http.accept.failed", reason=str(exc))
                await asyncio.sleep(0.1)
                continue
            if self.active >= self.max_connections:
                connection.close()
                self.refused += 1
                self._capped.report(
                    log,
                    "http.connections.capped",
                    f"{self.max_connections} connections open",
                    level="warning",
                    field="state",
                    consequence="new connections are closed until some end",
                )
                continue
            if self._capped.solved():
                log.info("http.connections.below_cap", refused=self.refused)
            self.active += 1  # counted here: the next accept must see it
            task = asyncio.create_task(self._serve(connection))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, connection: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=connection, limit=MAX_HEADER_BYTES)
        except OSError:
            connection.close()
            self.active -= 1
            return
        try:
            await self._handle(reader, writer)
        finally:
            self.active -= 1

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
        except asyncio.CancelledError:
            writer.transport.abort()  # shutting down
            raise

    def _answer(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain; charset=utf-8", b"GET or HEAD only\n"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            body = self._metrics()
            # Loaded by the exposition above (prometheus_client waits for the first scrape).
            from prometheus_client import CONTENT_TYPE_LATEST

            return "200 OK", CONTENT_TYPE_LATEST, body
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

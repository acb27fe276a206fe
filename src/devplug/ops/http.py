"""A small HTTP endpoint on the event loop: ``/metrics``, ``/healthz``, ``/readyz``.

prometheus_client's own server runs in threads; devplug keeps to one event loop, so this
serves GET and HEAD of three fixed paths over non-blocking sockets. ``/healthz`` answers when
the loop does (the handler runs on it); ``/readyz`` is 200 once every advertised resource is
registered with the kubelet, 503 with what is missing otherwise.

The port is unauthenticated and the kubelet's probes share it with whoever can reach it, so
no client may starve the daemon, nor keep the probes from their answer. Who gets a connection
is :mod:`.admission`'s (the request deadline, the cap, which connection gives way at the cap);
here, a request's headers are at most ``MAX_HEADER_BYTES``, must arrive within
``REQUEST_TIMEOUT_S`` of the accept, and the whole exchange within ``CONNECTION_TIMEOUT_S``;
at most ``MAX_CONNECTIONS`` are open at once.

Fairness between addresses lies in the order in which connections give way at the cap, not
in a cap per address: the kubelet's probes can share their address with the trickle (under
systemd every client is 127.0.0.1; a hostNetwork pod has the node's address), and a probe
whose request is on its way survives as many newer connections as its address may hold. With
64 clients trickling from the probe's own address and probes 1 s apart, 17 and 18 of 30
probes were answered under a cap of 8 per address, 30 of 30 under the cap of 32 alone. What
no order can do is tell a probe whose request is still on its way from a connection that has
sent nothing yet, on the same address: a client there that opens connections faster than
that request crosses can still close it (96 clients reconnecting within 50 ms, on one loaded
machine with the probe: 24 to 29 of 30 answered). From other addresses (pods), 96 such
clients: 30 of 30.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import structlog

from devplug.ops.admission import Admission, Connection

log = structlog.get_logger(__name__)

MAX_HEADER_BYTES = 8192
# A scrape or a probe takes milliseconds; a client holding a connection longer is idle or
# hostile. The whole exchange (request, answer, close) must fit in this.
CONNECTION_TIMEOUT_S = 5.0
# The kubelet and Prometheus send their request in one write right after connecting.
REQUEST_TIMEOUT_S = 2.0
# Prometheus and the kubelet's probes open one connection each at a time.
MAX_CONNECTIONS = 32
# Connections waiting in the kernel cost the daemon no descriptor; a deep queue lets a
# probe that arrives in a burst of connections wait there rather than be dropped.
LISTEN_BACKLOG = 128


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
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.host, self.port = host, port
        self._metrics = metrics
        self._not_ready = not_ready
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self.timeout_s = timeout_s
        # Who gets a connection: the cap, the counts (evicted, refused, active) and the deadline.
        self.connections = Admission(
            "http",
            self._serve,
            max_connections=max_connections,
            request_timeout_s=min(request_timeout_s, timeout_s),
        )

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (
            await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        if self.port == 0:
            self.port = listener.getsockname()[1]  # the one the OS chose (tests)
        self._accepting = asyncio.create_task(self.connections.accept(listener), name="http-accept")
        log.info("http.listening", address=f"{self.host}:{self.port}")

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        await self.connections.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve(self, connection: Connection) -> None:
        loop = asyncio.get_running_loop()
        sock = connection.sock
        async with asyncio.timeout(self.timeout_s):
            request = await self.connections.read_request(connection, b"\r\n\r\n", MAX_HEADER_BYTES)
            method, path = _request_line(request)
            status, content_type, body = self._answer(method, path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            await loop.sock_sendall(sock, head if method == "HEAD" else head + body)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

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
            text = "not ready: " + "; ".join(missing) + "\n"
            return "503 Service Unavailable", "text/plain; charset=utf-8", text.encode()
        return "404 Not Found", "text/plain; charset=utf-8", b"/metrics, /healthz or /readyz\n"


def _request_line(request: bytes) -> tuple[str, str]:
    first = request.split(b"\r\n", 1)[0].decode("latin-1")
    parts = first.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1]

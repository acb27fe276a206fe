"""A small HTTP endpoint on the event loop: ``/metrics``, ``/healthz``, ``/readyz``.

prometheus_client's own server runs in threads; devplug keeps to one event loop, so this
serves GET and HEAD of three fixed paths over non-blocking sockets. ``/healthz`` answers when
the loop does (the handler runs on it); ``/readyz`` is 200 once every advertised resource is
registered with the kubelet, 503 with what is missing otherwise.

The port is unauthenticated and the kubelet's probes share it with whoever can reach it, so
no client may starve the daemon, nor keep the probes from their answer:

- a request's headers must arrive within ``REQUEST_TIMEOUT_S`` of the accept, in total (a
  byte now and then does not extend it), and the whole exchange within
  ``CONNECTION_TIMEOUT_S``;
- at most ``MAX_CONNECTIONS`` connections are open at once;
- a connection that finds every slot taken does not wait: it takes the slot of a connection
  still sending its request, of the address holding the most connections; of those, one
  that has begun its request before one that has sent nothing yet, the oldest first. A probe
  sends its whole request in one write and is answered from the first read, so it is never
  one that has begun and not finished; a client that trickles is, and is closed in its
  place. Only when every slot is answering (milliseconds each) is a new connection closed
  unserved.

Fairness between addresses lies in that order, not in a cap per address: the kubelet's
probes can share their address with the trickle (under systemd every client is 127.0.0.1; a
hostNetwork pod has the node's address), and a probe whose request is on its way survives
as many newer connections as its address may hold. With 64 clients trickling from the
probe's own address and probes 1 s apart, 17 and 18 of 30 probes were answered under a cap
of 8 per address, 30 of 30 under the cap of 32 alone. What no order can do is tell a probe
whose request is still on its way from a connection that has sent nothing yet, on the same
address: a client there that opens connections faster than that request crosses can still
close it (96 clients reconnecting within 50 ms, on one loaded machine with the probe: 24 to
29 of 30 answered). From other addresses (pods), 96 such clients: 30 of 30.

Connections are accepted one at a time, and the loop turns once between accepts, so a closed
one gives its descriptor back before the next is taken: the descriptors the endpoint holds
stay within the cap plus a few, however many clients connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from devplug._kits.problems import ProblemLog

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


class _BadRequest(Exception):
    """The client sent more header bytes than allowed, or closed before the end."""


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    peer: str  # the client's address (IP), without the port
    accepted_at: float
    # True until the request's headers are all in: until then the connection may be evicted.
    reading: bool = True
    received: int = 0  # bytes of the request so far
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def close(self) -> None:
        self.sock.close()  # idempotent


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
        self._connections: set[_Connection] = set()
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.request_timeout_s = min(request_timeout_s, timeout_s)
        self.evicted = 0  # connections closed mid-request to make room for a new one
        self.refused = 0  # new connections closed unserved: every slot was answering
        # An episode of connections at the cap, logged once: a client that keeps the endpoint
        # at its cap would otherwise write a line per connection. It ends when every
        # connection is gone.
        self._cap = ProblemLog()

    @property
    def active(self) -> int:
        """Connections open now (being read or answered)."""
        return len(self._connections)

    @property
    def begun(self) -> int:
        """Connections that have sent part of their request and not the rest (yet)."""
        return sum(1 for c in self._connections if c.reading and c.received)

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
        self._accepting = asyncio.create_task(self._accept_loop(), name="http-accept")
        log.info("http.listening", address=f"{self.host}:{self.port}")

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        tasks = [c.task for c in self._connections if c.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # ------------------------------------------------------------------ admission

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and the like: try again shortly
                log.warning("http.accept.failed", reason=str(exc))
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            peer = str(address[0]) if isinstance(address, tuple) else str(address)
            if self._make_room():
                self._serve_connection(sock, peer)
            else:
                sock.close()
                self.refused += 1
            # One turn of the loop: an evicted connection's task closes its socket, and the
            # new one reads its request, before the next accept.
            await asyncio.sleep(0)

    def _make_room(self) -> bool:
        """Free a slot for a new connection if it needs one; False if none can be freed
        (every connection is being answered)."""
        if len(self._connections) >= self.max_connections:
            return self._evict(self._victim())
        return True

    def _victim(self) -> _Connection | None:
        """A connection still sending its request, of the address holding the most; of
        those, one that has begun its request before one that has sent nothing yet (a
        probe's request may be on its way: it comes whole, in one write), the oldest first."""
        held = Counter(c.peer for c in self._connections)
        reading = [c for c in self._connections if c.reading]
        if not reading:
            return None
        return min(reading, key=lambda c: (-held[c.peer], c.received == 0, c.accepted_at))

    def _evict(self, victim: _Connection | None) -> bool:
        self._cap.report(
            log,
            "http.connections.capped",
            "each new connection closes one still sending its request (of the address "
            "holding the most), or is closed itself when none is",
            level="warning",
            field="consequence",
            max_connections=self.max_connections,
        )
        if victim is None:
            return False
        self._connections.discard(victim)  # its slot is the new one's from now on
        if victim.task is not None:
            victim.task.cancel()  # the task closes the socket once asyncio has let go of it
        else:
            victim.close()
        self.evicted += 1
        return True

    def _serve_connection(self, sock: socket.socket, peer: str) -> None:
        connection = _Connection(sock, peer, time.monotonic())
        self._connections.add(connection)
        task = asyncio.create_task(self._serve(connection), name=f"http:{peer}")
        connection.task = task
        # A task cancelled before it ever ran skips its own clean-up: this covers it.
        task.add_done_callback(lambda _: self._finished(connection))

    def _finished(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        connection.close()
        if not self._connections and self._cap.solved():
            log.info("http.connections.below_cap", evicted=self.evicted, refused=self.refused)

    # ------------------------------------------------------------------ one exchange

    async def _serve(self, connection: _Connection) -> None:
        loop = asyncio.get_running_loop()
        sock = connection.sock
        try:
            async with asyncio.timeout(self.timeout_s):
                request = await self._read_request(loop, connection)
                connection.reading = False
                method, path = _request_line(request)
                status, content_type, body = self._answer(method, path)
                head = (
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()
                await loop.sock_sendall(sock, head if method == "HEAD" else head + body)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
        except (TimeoutError, OSError, _BadRequest):
            # A client that sends nothing sensible, or does not read, gets nothing more.
            pass
        finally:
            # Cancelled (evicted, shutting down) or done: asyncio has removed the socket from
            # its selector by now (a cancelled read's clean-up runs before the task resumes),
            # so closing cannot hit a descriptor number reused since.
            self._finished(connection)

    async def _read_request(
        self, loop: asyncio.AbstractEventLoop, connection: _Connection
    ) -> bytes:
        """The request's head, up to its blank line; within ``request_timeout_s`` in total."""
        data = bytearray()
        async with asyncio.timeout(self.request_timeout_s):
            while True:
                chunk = await loop.sock_recv(connection.sock, 4096)
                if not chunk:
                    raise _BadRequest("closed before the end of the request")
                searched_from = max(len(data) - 3, 0)
                data += chunk
                connection.received = len(data)
                end = data.find(b"\r\n\r\n", searched_from)
                if end >= 0:
                    return bytes(data[: end + 4])
                if len(data) > MAX_HEADER_BYTES:
                    raise _BadRequest(f"request headers over {MAX_HEADER_BYTES} bytes")

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

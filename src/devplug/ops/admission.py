"""Who gets a connection, and for how long it may take to ask: the admission policy of the
daemon's two listeners, the metrics port (:mod:`.http`) and the control channel
(:mod:`.control`). Each plugs in its protocol (how to serve one connection, where a request
ends, how long it may be); the defence against clients that hold connections is here, the
same for both:

- the request must arrive within the request deadline of the accept, in total (a byte now
  and then does not extend it), and be at most the protocol's size;
- at most ``max_connections`` connections are open at once;
- a connection that finds every slot taken does not wait: it takes the slot of a connection
  still sending its request, of the address holding the most connections; of those, one
  that has begun its request before one that has sent nothing yet, the oldest first. The
  kubelet's probes and devplug's commands send their whole request in one write, so they are
  never one that has begun and not finished; a client that trickles is, and is closed in
  their place. Only when every slot is being answered is a new connection closed unserved.
  (On a unix socket every client has the same address: the order is begun before silent,
  then the oldest.)
- the cap is logged once per episode (``<area>.connections.capped``), and its end when every
  connection has gone (``<area>.connections.below_cap``, with the counts): a client that
  keeps the listener at its cap would otherwise write a line per connection.

Connections are accepted one at a time, and the loop turns once between accepts, so a closed
one gives its descriptor back before the next is taken: the descriptors a listener holds stay
within the cap plus a few, however many clients connect.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from devplug._kits.problems import ProblemLog, error_reason

log = structlog.get_logger(__name__)


class RequestTooLong(Exception):
    """The client sent more than the protocol's request size without ending its request."""


@dataclass(eq=False, slots=True)
class Connection:
    sock: socket.socket
    peer: str  # the client's address (IP) without the port; "" on a unix socket
    accepted_at: float  # the event loop's clock
    # True until the request is all in: until then the connection may be evicted.
    reading: bool = True
    received: int = 0  # bytes of the request so far
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def close(self) -> None:
        self.sock.close()  # idempotent


# Serves one admitted connection: reads its request (with Admission.read_request), answers.
Serve = Callable[[Connection], Awaitable[None]]


class Admission:
    """The connections of one listener: admits, evicts, times the request, ends them all.

    ``area`` names the listener in its events (``http``, ``control``). ``serve`` may let
    TimeoutError, OSError, EOFError and :class:`RequestTooLong` escape: a client that sends
    nothing sensible, or does not read, gets nothing more.
    """

    def __init__(
        self, area: str, serve: Serve, *, max_connections: int, request_timeout_s: float
    ) -> None:
        self.area = area
        self._serve = serve
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self._connections: set[Connection] = set()
        self.evicted = 0  # connections closed mid-request to make room for a new one
        self.refused = 0  # new connections closed unserved: every slot was being answered
        self._cap = ProblemLog()  # an episode at the cap, logged once

    @property
    def active(self) -> int:
        """Connections open now (being read or answered)."""
        return len(self._connections)

    @property
    def begun(self) -> int:
        """Connections that have sent part of their request and not the rest (yet)."""
        return sum(1 for c in self._connections if c.reading and c.received)

    async def accept(self, listener: socket.socket) -> None:
        """Accept on ``listener`` (non-blocking) until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: try again shortly
                log.warning(f"{self.area}.accept.failed", reason=error_reason(exc))
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            peer = str(address[0]) if isinstance(address, tuple) else ""
            if self._make_room():
                self._admit(Connection(sock, peer, loop.time()))
            else:
                sock.close()
                self.refused += 1
            # One turn of the loop: an evicted connection's task closes its socket, and the
            # new one reads its request, before the next accept.
            await asyncio.sleep(0)

    async def close(self) -> None:
        """End every connection (their tasks cancelled and awaited, their sockets closed)."""
        tasks = [c.task for c in self._connections if c.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()

    async def read_request(
        self, connection: Connection, terminator: bytes, max_bytes: int
    ) -> bytes:
        """The request, up to and with ``terminator``, at most ``max_bytes`` with it; it must
        be in within the request deadline of the accept. TimeoutError: it was not;
        EOFError: the client closed before its end; RequestTooLong: it is longer."""
        loop = asyncio.get_running_loop()
        data = bytearray()
        async with asyncio.timeout_at(connection.accepted_at + self.request_timeout_s):
            while True:
                chunk = await loop.sock_recv(connection.sock, max_bytes)
                if not chunk:
                    raise EOFError("closed before the end of the request")
                searched_from = max(len(data) - len(terminator) + 1, 0)
                data += chunk
                connection.received = len(data)
                end = data.find(terminator, searched_from)
                if 0 <= end <= max_bytes - len(terminator):
                    connection.reading = False
                    return bytes(data[: end + len(terminator)])
                if len(data) >= max_bytes:
                    raise RequestTooLong(f"a request is at most {max_bytes} bytes")

    def _make_room(self) -> bool:
        """Free a slot for a new connection if it needs one; False if none can be freed
        (every connection is being answered)."""
        if len(self._connections) < self.max_connections:
            return True
        self._cap.report(
            log,
            f"{self.area}.connections.capped",
            "each new connection closes one still sending its request (of the address "
            "holding the most), or is closed itself when none is",
            level="warning",
            field="consequence",
            max_connections=self.max_connections,
        )
        victim = self._victim()
        if victim is None:
            return False
        self._connections.discard(victim)  # its slot is the new one's from now on
        if victim.task is not None:
            victim.task.cancel()  # the task closes the socket once asyncio has let go of it
        else:
            victim.close()
        self.evicted += 1
        return True

    def _victim(self) -> Connection | None:
        """A connection still sending its request, of the address holding the most; of
        those, one that has begun its request before one that has sent nothing yet (a
        well-behaved request may be on its way: it comes whole, in one write), the oldest
        first."""
        held = Counter(c.peer for c in self._connections)
        reading = [c for c in self._connections if c.reading]
        if not reading:
            return None
        return min(reading, key=lambda c: (-held[c.peer], c.received == 0, c.accepted_at))

    def _admit(self, connection: Connection) -> None:
        self._connections.add(connection)
        name = f"{self.area}:{connection.peer}" if connection.peer else f"{self.area}-connection"
        task = asyncio.create_task(self._run(connection), name=name)
        connection.task = task
        # A task cancelled before it ever ran skips its own clean-up: this covers it.
        task.add_done_callback(lambda _: self._finished(connection))

    async def _run(self, connection: Connection) -> None:
        try:
            await self._serve(connection)
        except (TimeoutError, OSError, EOFError, RequestTooLong):
            pass  # a client that sends nothing sensible, or does not read, gets nothing more
        finally:
            # Cancelled (evicted, shutting down) or done: asyncio has removed the socket from
            # its selector by now (a cancelled read's clean-up runs before the task resumes),
            # so closing cannot hit a descriptor number reused since.
            self._finished(connection)

    def _finished(self, connection: Connection) -> None:
        self._connections.discard(connection)
        connection.close()
        if not self._connections and self._cap.solved():
            log.info(
                f"{self.area}.connections.below_cap", evicted=self.evicted, refused=self.refused
            )

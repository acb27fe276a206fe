"""The metrics port answers the kubelet's probes whatever other clients do (issue 25, item 4).

Hostile clients here trickle: they connect, send a byte now and then, never end their
request, and connect again as soon as they are closed. The probes are sent as the kubelet
sends them (the whole request in one write) and wait as long as its ``timeoutSeconds`` (5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

from structlog.testing import capture_logs

from devplug.ops.http import MAX_CONNECTIONS, StatusEndpoint
from devplug.testing import daemon_process, eventually

PROBE = (
    b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:9400\r\nUser-Agent: kube-probe/1.31\r\n"
    b"Accept: */*\r\nConnection: close\r\n\r\n"
)
PROBE_TIMEOUT_S = 5.0  # the DaemonSet's timeoutSeconds
TRICKLE_INTERVAL_S = 0.5


def listening_port(log: Path) -> int | None:
    """The port the daemon's metrics endpoint took (``http.listening`` in its log)."""
    for line in log.read_text().splitlines():
        if '"http.listening"' in line:
            return int(json.loads(line)["address"].rsplit(":", 1)[1])
    return None


async def probe(port: int, source: str = "127.0.0.1") -> int | None:
    """The HTTP status the kubelet would see; None for no answer (closed, or too late)."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
            try:
                writer.write(PROBE)
                answer = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    head = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(head[1]) if len(head) >= 2 and head[0].startswith(b"HTTP/") else None


class Trickle:
    """Clients that each hold a connection open with a byte now and then, forever."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.opened = 0  # connections the server accepted (it may close them at once)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, sources: list[str], per_source: int) -> None:
        for source in sources:
            for _ in range(per_source):
                self._tasks.append(asyncio.create_task(self._client(source)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, source: str) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=(source, 0)
                )
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.opened += 1
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
                while True:
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(TRICKLE_INTERVAL_S):
                            await reader.read(1)  # only ever EOF (or a reset): closed
                            break
                    writer.write(b"x")
            except OSError:
                pass
            finally:
                writer.close()
            await asyncio.sleep(0.05)  # and straight back


# Loopback addresses standing for other pods (Linux routes all of 127/8 to lo). Clients on
# the probe's own address are test_at_the_cap_one_address_gives_way_to_its_own_probe's: a
# flood there races the probe's own write (see devplug.ops.http), which a test cannot time.
OTHER_PODS = [f"127.0.0.{n}" for n in range(2, 10)]


async def test_probes_are_answered_while_96_slow_clients_trickle(
    short_dir: Path, kubelet_dir: Path, tmp_path: Path
) -> None:
    """96 trickling clients from eight other addresses (three times the connection cap) keep
    the port at its cap for the whole run; every one of 30 probes from the kubelet's own
    address is answered 200 all the same."""
    config = short_dir / "config.yaml"
    config.write_text(
        "metrics_address: 127.0.0.1:0\nhotplug: {source: none}\nscanners:\n  generic:\n"
        "    - {resource: example.com/mem, match: {subsystem: mem, devnode: /dev/null}}\n"
    )
    per_source = 12
    assert per_source * len(OTHER_PODS) > 2 * MAX_CONNECTIONS
    log = tmp_path / "run.log"
    async with daemon_process(config, kubelet_dir, output=log) as process:
        await eventually(lambda: listening_port(log) is not None, 60, what="http.listening")
        port = listening_port(log)
        assert port is not None and await probe(port) == 200
        trickle = Trickle(port)
        trickle.start(OTHER_PODS, per_source)
        try:
            # Every client has connected, and the server is closing some to admit others.
            await eventually(lambda: trickle.opened >= 2 * per_source * len(OTHER_PODS), 30)
            answers = []
            for _ in range(30):
                answers.append(await probe(port))
                await asyncio.sleep(0.1)
        finally:
            await trickle.stop()
        assert process.returncode is None
    assert answers == [200] * 30, f"{answers.count(200)} of 30 probes answered"


# ---------------------------------------------------------------------------- the policy


@contextlib.asynccontextmanager
async def endpoint(**limits: float) -> AsyncIterator[StatusEndpoint]:
    served = StatusEndpoint("127.0.0.1", 0, lambda: b"", list, **limits)  # type: ignore[arg-type]
    await served.start()
    try:
        yield served
    finally:
        await served.close()


async def partial(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent part of a request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = 0.2) -> bool:
    """True if the server closes the connection within ``within_s``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within_s):
            try:
                return await reader.read(1) == b""
            except ConnectionResetError:
                return True
    return False


async def opened_in_order(
    served: StatusEndpoint, port: int, sources: list[str]
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """Partial connections from ``sources``, each one served before the next is opened."""
    connections = []
    for source in sources:
        connections.append(await partial(port, source))
        count = len(connections)
        await eventually(
            lambda count=count: served.connections.active == count,  # type: ignore[misc]
            what=f"{count} connections served",
        )
    return connections


def close_all(connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, writer in connections:
        writer.close()


async def test_at_the_cap_one_address_gives_way_to_its_own_probe() -> None:
    """Under systemd every client is 127.0.0.1: a probe from there is answered all the same,
    in place of that address's oldest connection that has not finished its request."""
    async with endpoint(max_connections=3) as served:
        port = served.port
        held = await opened_in_order(served, port, ["127.0.0.1"] * 3)
        try:
            assert await probe(port) == 200
            assert [await closed_by_server(reader) for reader, _ in held] == [True, False, False]
            assert served.connections.evicted == 1 and served.connections.refused == 0
        finally:
            close_all(held)


async def test_the_cap_is_logged_once_per_episode() -> None:
    """A client keeping the port at its cap must not write a line per connection: one
    warning while the cap holds, ``below_cap`` when every connection has ended, and a
    warning again at the next episode."""

    def said(logs: Sequence[Mapping[str, object]]) -> list[tuple[object, object]]:
        return [(e["event"], e["log_level"]) for e in logs if e["log_level"] != "debug"]

    async with endpoint(max_connections=2) as served:
        port = served.port
        for episode in range(2):
            with capture_logs() as logs:
                held = await opened_in_order(served, port, ["127.0.0.2"] * 2)
                try:
                    for _ in range(3):  # each probe takes the slot of a held connection
                        assert await probe(port, "127.0.0.3") == 200
                        held.append(await partial(port, "127.0.0.2"))
                        await eventually(
                            lambda: served.connections.active == 2, what="at the cap again"
                        )
                finally:
                    close_all(held)
                await eventually(
                    lambda: served.connections.active == 0, what="every connection ended"
                )
            assert served.connections.evicted == 3 * (episode + 1)
            assert said(logs) == [
                ("http.connections.capped", "warning"),
                ("http.connections.below_cap", "info"),
            ], f"episode {episode}"


async def test_at_the_cap_the_address_holding_most_gives_way() -> None:
    """A pod holding most of the slots loses its oldest one; another pod's slow connection
    (older still) and the probe's address keep theirs."""
    async with endpoint(max_connections=4) as served:
        port = served.port
        held = await opened_in_order(
            served, port, ["127.0.0.3", "127.0.0.2", "127.0.0.2", "127.0.0.2"]
        )
        try:
            assert await probe(port, "127.0.0.1") == 200
            closed = [await closed_by_server(reader) for reader, _ in held]
            assert closed == [False, True, False, False]
        finally:
            close_all(held)


async def test_one_that_has_begun_its_request_gives_way_before_one_that_has_sent_nothing() -> None:
    """A connection that has sent nothing yet may be a probe whose request is on its way; one
    that has sent part of a request and stopped is the slow one, even if it is younger."""
    async with endpoint(max_connections=2) as served:
        port = served.port
        silent = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        await eventually(
            lambda: served.connections.active == 1, what="the silent connection served"
        )
        held = [silent, await partial(port, "127.0.0.2")]
        await eventually(lambda: served.connections.begun == 1, what="the partial request read")
        try:
            assert await probe(port, "127.0.0.1") == 200
            assert [await closed_by_server(reader) for reader, _ in held] == [False, True]
        finally:
            close_all(held)


async def test_the_request_deadline_is_for_the_whole_request_not_each_byte() -> None:
    """A byte every 0.05 s does not keep a connection: it is cut at the request deadline
    (0.3 s here), long before the test gives up (a deadline per byte would never cut it)."""
    async with endpoint(request_timeout_s=0.3) as served:
        reader, writer = await partial(served.port, "127.0.0.1")
        try:
            async with asyncio.timeout(10):
                while not await closed_by_server(reader, within_s=0.05):
                    writer.write(b"x")
        finally:
            writer.close()
        await eventually(lambda: served.connections.active == 0, what="the endpoint let go of it")

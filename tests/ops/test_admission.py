"""The admission policy's own guarantee that neither endpoint's protocol can show: a connection
whose task is cancelled before it ever ran (evicted or shut down in the same turn it was
admitted) still gives back its slot and its socket."""

from __future__ import annotations

import asyncio
import socket

from devplug.ops.admission import Admission, Connection


async def test_a_connection_cancelled_before_it_ran_gives_back_its_slot_and_socket() -> None:
    started: list[Connection] = []

    async def serve(connection: Connection) -> None:
        started.append(connection)

    admission = Admission("test", serve, max_connections=2, request_timeout_s=1.0)
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        connection = Connection(ours, "", asyncio.get_running_loop().time())
        admission._admit(connection)  # as the accept loop does
        assert connection.task is not None and admission.active == 1
        connection.task.cancel()  # before its first step: its own finally never runs
        await asyncio.gather(connection.task, return_exceptions=True)
        await asyncio.sleep(0)  # the task's done callbacks
        assert started == []
        assert admission.active == 0
        assert ours.fileno() == -1  # closed
    finally:
        ours.close()
        theirs.close()

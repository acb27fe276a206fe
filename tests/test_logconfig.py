"""grpc-core's own lines stay out of devplug's JSON log (issue 25, item 2).

grpc-core writes its log lines itself, in absl's plain-text format (``E1126 01:36:30.355336
13329 add_port.cc:83] Failed to add port ...``), straight to file descriptor 2, where
devplug's JSON lines go. Each test runs ``devplug run`` into a real failure that grpc-core
logs, once per retry: a plugin socket that cannot be created, and a kubelet that answers
Register with GOAWAY. The daemon's stderr must carry only JSON lines, and devplug's own line
about the failure must be there.

The test suite's conftest sets GRPC_VERBOSITY for its own process; the daemon here gets an
environment without it, as on a node.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
import sys
from pathlib import Path

import pytest

from devplug.testing import daemon_process, eventually

# HTTP/2 frame types (RFC 9113, section 6) and the GOAWAY error code a server sends to a
# client that pings too often; grpc-core logs it at ERROR on the client side.
SETTINGS, GOAWAY = 0x4, 0x7
ENHANCE_YOUR_CALM = 0xB
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", 0) + payload


def write_config(directory: Path) -> Path:
    config = directory / "config.yaml"
    config.write_text(
        "log_level: debug\nhotplug: {source: none}\nscanners:\n  generic:\n"
        "    - {resource: example.com/mem, match: {subsystem: mem, devnode: /dev/null}}\n"
    )
    return config


def lines_of(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def events(log: Path, event: str) -> int:
    return sum(f'"event": "{event}"' in line for line in lines_of(log))


def not_json(log: Path) -> list[str]:
    odd = []
    for line in lines_of(log):
        try:
            json.loads(line)
        except ValueError:
            odd.append(line)
    return odd


@pytest.fixture
def node_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's environment as on a node: nothing set for grpc."""
    for name in ("GRPC_VERBOSITY", "GRPC_TRACE"):
        monkeypatch.delenv(name, raising=False)


class GoawayKubelet:
    """A kubelet.sock that answers every connection with SETTINGS and GOAWAY
    (ENHANCE_YOUR_CALM, "too_many_pings"), as a kubelet tired of a client's pings does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.goaways = 0
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> GoawayKubelet:
        self._server = await asyncio.start_unix_server(self._answer, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(len(CLIENT_PREFACE))
            goaway = struct.pack(">II", 0, ENHANCE_YOUR_CALM) + b"too_many_pings"
            writer.write(frame(SETTINGS) + frame(GOAWAY, goaway))
            await writer.drain()
            self.goaways += 1
            await reader.read()  # until the client lets go
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.mark.usefixtures("node_environment")
async def test_a_kubelet_sending_goaway_leaves_only_json_on_stderr(
    short_dir: Path, kubelet_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "run.log"
    async with (
        GoawayKubelet(kubelet_dir / "kubelet.sock") as kubelet,
        daemon_process(write_config(short_dir), kubelet_dir, output=log) as process,
    ):
        # Several connections, each refused with GOAWAY (grpc-core's line each time).
        await eventually(lambda: kubelet.goaways >= 3, 60, what="three GOAWAYs sent")
        await eventually(
            lambda: events(log, "kubelet.register.failed") >= 1, 60, what="register failed"
        )
        process.terminate()
        await process.wait()
    assert not_json(log) == []


@pytest.mark.usefixtures("node_environment")
async def test_a_socket_that_cannot_be_created_leaves_only_json_on_stderr(
    short_dir: Path, kubelet_dir: Path, tmp_path: Path
) -> None:
    """A kubelet dir devplug may not write (root without DAC override, as in a locked-down
    container): gRPC cannot bind the plugin socket, and devplug retries."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux) to drop root's DAC override")
    kubelet = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    kubelet.bind(str(kubelet_dir / "kubelet.sock"))  # there, so devplug tries to listen
    kubelet.listen()
    kubelet_dir.chmod(0o555)
    # The daemon's interpreter, run without the capability that lets root write anywhere.
    python = short_dir / "python"
    drop = "--bounding-set=-dac_override,-dac_read_search"
    python.write_text(f'#!/bin/sh\nexec {setpriv} {drop} "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    log = tmp_path / "run.log"
    try:
        async with daemon_process(
            write_config(short_dir), kubelet_dir, output=log, python=str(python)
        ) as process:
            # The first failure at error, each retry after it at debug.
            await eventually(
                lambda: events(log, "server.listen.failed") >= 3, 60, what="three listen failures"
            )
            process.terminate()
            await process.wait()
    finally:
        kubelet_dir.chmod(0o755)
        kubelet.close()
    assert not_json(log) == []

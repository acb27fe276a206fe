"""grpc-core's own lines come into devplug's JSON log, counted, never as plain text (issue 25).

grpc-core writes its log lines itself, in absl's plain-text format (``E1126 01:36:30.355336
13329 add_port.cc:83] Failed to add port ...``), straight to file descriptor 2, where
devplug's JSON lines go. Each daemon test runs ``devplug run`` into a real failure that
grpc-core logs, once per retry: a plugin socket that cannot be created, and a kubelet that
answers Register with GOAWAY. The daemon's stderr must carry only JSON lines, with gRPC's
line as ``grpc.core.log`` (what devplug's own line cannot say: the GOAWAY's reason) and its
repeats counted. The pipe that carries them never holds a writer, and a crash still leaves
its traceback.

The test suite's conftest sets GRPC_VERBOSITY for its own process; the daemon here gets an
environment without it, as on a node.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devplug._kits.repeats import DISTINCT_PER_EPISODE
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
    # gRPC's line, with the reason devplug's own (DEADLINE_EXCEEDED) cannot give, once in
    # full; the GOAWAYs after it only counted.
    said = [e for e in grpc_lines(log) if "too_many_pings" in e["message"]]
    full = [e for e in said if "repeated" not in e]
    assert len(full) == 1, said
    assert full[0]["level"] == "error" and full[0]["source"].startswith("chttp2_transport.cc:")


def grpc_lines(log: Path) -> list[dict[str, Any]]:
    found = (json.loads(line) for line in lines_of(log))
    return [entry for entry in found if entry["event"] == "grpc.core.log"]


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
    # gRPC's own reason, from its listener; a new socket name each retry, so at most three
    # in full per source, the rest counted.
    said = [e for e in grpc_lines(log) if e["source"].startswith("add_port.cc:")]
    assert said and all("Permission denied" in e["message"] for e in said), said
    assert len([e for e in said if "repeated" not in e]) <= DISTINCT_PER_EPISODE


# What the daemon does with fd 2, in a process of its own: nobody reads the pipe (no event
# loop follows it), so C code's lines fill it, and then fail rather than wait; Python's
# stderr (structlog's lines) is the real one all along.
FULL_PIPE = """
import os
import structlog
from devplug.logconfig import CoreStderr, configure

configure("json")
CoreStderr().capture()
line = b"E1126 00:00:00.000000 1 filler.cc:1] " + b"x" * 200 + b"\\n"
written = 0
try:
    while True:
        written += os.write(2, line)
except BlockingIOError:
    pass
structlog.get_logger("test").info("test.pipe.full", written=written)
os._exit(0)
"""


def test_c_code_writing_to_a_full_pipe_is_refused_not_held_and_python_logs_on(
    tmp_path: Path,
) -> None:
    log = tmp_path / "stderr"
    with log.open("wb") as stderr:
        # The timeout bounds a writer that would be held for good: the failure under test.
        subprocess.run([sys.executable, "-c", FULL_PIPE], stderr=stderr, timeout=60, check=True)
    (entry,) = (json.loads(line) for line in lines_of(log))
    assert entry["event"] == "test.pipe.full"
    assert entry["written"] >= 65536  # at least a default pipe's worth held, then refused


ABORTING_PLUGIN = """
import os
import sys

from devplug import DeviceInfo, DeviceNode, serve
from devplug.testing import StaticScanner


class Aborts(StaticScanner):
    def start(self, resource):
        os.abort()  # as grpc-core does after a failed check


def dummy(raw, field):
    return Aborts({"example.com/dummy": {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})


sys.exit(serve({"dummy": dummy}, program="dummy-plugin", version="1.0.0"))
"""


@pytest.mark.usefixtures("node_environment")
def test_a_crash_while_serving_leaves_every_threads_traceback_on_stderr(
    short_dir: Path, kubelet_dir: Path
) -> None:
    """fd 2 is a pipe the dead process can no longer read: the traceback goes to the real
    stderr (faulthandler), where the crash's own text would otherwise be lost."""
    script = short_dir / "plugin.py"
    script.write_text(ABORTING_PLUGIN)
    config = short_dir / "config.yaml"
    config.write_text(
        f"kubelet_dir: {kubelet_dir}\nlog_format: json\ncdi: {{enabled: false}}\n"
        "scanners:\n  dummy: {}\n"
    )
    ended = subprocess.run(
        [sys.executable, str(script), "run", "--config", str(config)],
        capture_output=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DEVPLUG_")},
    )
    assert ended.returncode == -signal.SIGABRT
    stderr = ended.stderr.decode(errors="replace")
    assert "Fatal Python error: Aborted" in stderr
    assert re.search(r'File ".*plugin\.py", line \d+ in start', stderr), stderr

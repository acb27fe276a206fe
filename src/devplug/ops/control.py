"""The daemon's local control channel: a unix socket for an operator's commands.

``devplug cordon`` and ``devplug uncordon`` change the daemon's cordons through it, and
``devplug status`` asks it which devices are cordoned and why. The socket is
``<kubelet dir>/devplug/<name>.sock``: beside the plugin sockets, in a dir of the daemon's own,
because the kubelet deletes every file of its own dir when it starts, never a dir in it. The
commands find it there, as ``status`` finds the plugin sockets; ``<name>`` (the program's,
``devplug`` or a plugin author's) keeps two daemons on one node apart.

Protocol: one request per connection, a JSON object on one line (``{"op": "list"}``, at most
``MAX_REQUEST_BYTES`` with its newline), answered with one JSON object on one line, after which
the daemon closes. Every answer has ``ok``; a refusal has ``error``, a message for the
operator. What the requests mean is the composition's handler's: this module only carries
them.

Who may talk: the socket is mode 0600 in a dir of mode 0700, both the daemon's user's, as
narrow as the plugin sockets (root, which the kubelet is). It is claimed as they are: bound
under a temporary name, made 0600, then hard-linked to its name, which fails rather than
replace someone's live socket (a stale one, whose daemon is gone, is removed); it is removed on
close only while it is still ours. If the dir or the socket is removed (the kubelet dir wiped
and made again), it is made again: the channel looks whenever the kubelet dir watch reports a
change, and every ``BACKSTOP_S``.

No client may stall the daemon or keep the next one out. Who gets a connection is
:mod:`.admission`'s, as for the metrics port: the request line must arrive within
``REQUEST_TIMEOUT_S`` of the connect, in total (a byte now and then does not extend it); at
most ``MAX_CONNECTIONS`` are open at once, and a new connection when every one is taken closes
one still sending its request, one that has begun it before one that has sent nothing yet (the
commands send theirs in one write at once), the oldest first, or is closed itself when every
one is being answered. Here, a longer line is refused unread, and the answer must be taken
within ``ANSWER_TIMEOUT_S``. A line that is not a JSON object (one nested past what the parser
takes among them) is answered with why, and logged (``control.request.refused``) at a bounded
rate: a client sending such lines in a loop writes a few lines of log per
``REFUSAL_LOG_INTERVAL_S``. The handler runs to its end whatever the client does (a cordon
asked for is a cordon done, even if the command was interrupted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from devplug._kits.problems import ProblemLog, error_reason
from devplug._kits.repeats import RepeatLog
from devplug._kits.socket_claim import SocketIdentity, SocketInUseError, claim, release
from devplug._kits.values import Watchable
from devplug.naming import TEMP_PREFIX
from devplug.ops.admission import Admission, Connection, RequestTooLong

log = structlog.get_logger(__name__)

CONTROL_DIR = "devplug"
SOCKET_SUFFIX = ".sock"
SOCKET_MODE = 0o600
DIR_MODE = 0o700
# A request names a resource, a device id and a reason of 200 characters at most.
MAX_REQUEST_BYTES = 4096
# What a command reads of an answer (every cordon of a node, with reasons, fits many times).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
REQUEST_TIMEOUT_S = 2.0
ANSWER_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16
LISTEN_BACKLOG = 64
# The inotify watch of the kubelet dir wakes the channel; this only backs it up.
BACKSTOP_S = 60.0
# Refused requests: the first few in full, then one summary line per this many seconds.
REFUSAL_LOG_INTERVAL_S = 10.0

_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]")

# The composition's answer to a request (a JSON object): a JSON object with "ok".
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ChannelError(Exception):
    """A command got no answer from the daemon: the message says why."""


def encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """A JSON object of one line; ValueError otherwise."""
    try:
        value = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:
        # The parser recurses per nesting level: a line of 3,000 '[' passes Python's limit.
        raise ValueError("nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def control_dir(kubelet_dir: Path) -> Path:
    return kubelet_dir / CONTROL_DIR


def control_name(program: str) -> str:
    """The file name a daemon's program name gives its socket and state file: letters,
    digits, ``.``, ``_`` and ``-`` (others become ``_``), at most 64, never hidden."""
    name = _NOT_IN_NAME.sub("_", program)[:64].lstrip(".")
    return name or "devplug"


def socket_path(kubelet_dir: Path, name: str) -> Path:
    """The control socket of the daemon called ``name`` (a :func:`control_name`)."""
    return control_dir(kubelet_dir) / f"{name}{SOCKET_SUFFIX}"


def control_sockets(kubelet_dir: Path) -> list[Path]:
    """The daemons' control sockets in ``kubelet_dir`` (none when it has no control dir)."""
    found = []
    try:
        with os.scandir(control_dir(kubelet_dir)) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.name.endswith(SOCKET_SUFFIX):
                    continue
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                        found.append(Path(entry.path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found)


async def ask(path: Path, request: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """Send ``request`` to the daemon at ``path``; its answer. ChannelError: no answer."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(path, limit=MAX_ANSWER_BYTES)
            try:
                writer.write(encode(request))
                await writer.drain()
                line = await reader.readuntil(b"\n")
            finally:
                writer.close()
    except TimeoutError:
        raise ChannelError(f"{path}: no answer within {timeout:g} s") from None
    except PermissionError:
        raise ChannelError(
            f"{path}: permission denied: only the daemon's user (root) may use it"
        ) from None
    except ConnectionRefusedError:
        raise ChannelError(f"{path}: nobody listens (the daemon is not running)") from None
    except FileNotFoundError:
        raise ChannelError(f"{path}: no such socket (the daemon is not running)") from None
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        raise ChannelError(f"{path}: the daemon closed without a whole answer") from None
    except OSError as exc:
        raise ChannelError(f"{path}: {error_reason(exc)}") from None
    try:
        return decode(line)
    except ValueError as exc:
        raise ChannelError(f"{path}: the answer is {exc}") from None


def _own_dir(directory: Path) -> None:
    """Make the control dir (0700) if it is missing; refuse one that is not a dir of ours, and
    narrow one that others may enter. Blocking (a few syscalls)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, DIR_MODE)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SocketInUseError(f"{directory} is not a directory of the daemon's user; remove it")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(directory, DIR_MODE)


class ControlChannel:
    """Serves ``handle`` on the unix socket ``path``; see the module's docstring."""

    def __init__(
        self,
        path: Path,
        handle: Handler,
        *,
        changes: Watchable[int] | None = None,
        on_listening: Callable[[], Awaitable[None]] | None = None,
        backstop_s: float = BACKSTOP_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        answer_timeout_s: float = ANSWER_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.path = path
        self._handle = handle
        # Bumps when the kubelet dir changes (its watch): time to look at the socket.
        self._changes = changes
        # Called each time the socket is (re)made (the dir may have been made again too).
        self._on_listening = on_listening
        self.backstop_s = backstop_s
        self.answer_timeout_s = answer_timeout_s
        self._listener: socket.socket | None = None
        self._own: SocketIdentity | None = None
        self._accepting: asyncio.Task[None] | None = None
        # Who gets a connection: the cap, the counts (evicted, refused, active) and the deadline.
        self.connections = Admission(
            "control",
            self._serve,
            max_connections=max_connections,
            request_timeout_s=request_timeout_s,
        )
        self._refusals = RepeatLog(log, REFUSAL_LOG_INTERVAL_S)

    def intact(self) -> bool:
        """Whether it listens and ``path`` is still its socket."""
        return self._listener is not None and SocketIdentity.of(self.path) == self._own

    async def run(self) -> None:
        """Listen, and listen again whenever the socket is gone, until cancelled."""
        problems = ProblemLog()
        seen = self._changes.version if self._changes is not None else 0
        try:
            while True:
                if not self.intact():
                    await self._relisten(problems)
                seen = await self._next_look(seen)
        finally:
            await self.close()

    async def _relisten(self, problems: ProblemLog) -> None:
        try:
            await self.listen()
        except (OSError, SocketInUseError) as exc:
            missing = not self.path.parent.parent.is_dir()
            reason = error_reason(exc) if isinstance(exc, OSError) else str(exc)
            problems.report(
                log,
                "control.unavailable",
                "no kubelet dir yet" if missing else reason,
                level="info" if missing else "error",
                socket=str(self.path),
                effect="cordon, uncordon and status's cordons wait for it; devices are served",
            )
            return
        problems.solved()
        log.info("control.listening", socket=str(self.path))
        if self._on_listening is not None:
            await self._on_listening()

    async def _next_look(self, seen: int) -> int:
        """Wait for a change in the kubelet dir, or the backstop; the changes' version."""
        changes = self._changes
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.backstop_s):
                if changes is None:
                    await asyncio.Event().wait()
                else:
                    await changes.wait_for(lambda _: changes.version != seen)
                    return changes.version
        return seen

    async def listen(self) -> None:
        """(Re)make the socket and accept on it. OSError or SocketInUseError: it could not be
        made."""
        await self._stop()
        directory = self.path.parent
        _own_dir(directory)
        temporary = directory / f"{TEMP_PREFIX}{secrets.token_hex(6)}{SOCKET_SUFFIX}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.fspath(temporary))
            os.chmod(temporary, SOCKET_MODE)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
            await claim(
                temporary,
                self.path,
                in_use_probe_s=1.0,
                in_use_hint="is a second daemon of the same name running on this node?",
                on_stale_removed=self._stale_removed,
            )
        except BaseException:
            listener.close()
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        self._listener = listener
        self._own = SocketIdentity.of(self.path)
        self._accepting = asyncio.create_task(
            self.connections.accept(listener), name="control-accept"
        )

    def _stale_removed(self) -> None:
        log.info("control.stale_socket.removed", socket=str(self.path))

    async def close(self) -> None:
        """Stop accepting, end every connection, remove the socket if it is still ours, and
        the dir if nothing else is in it (a state file, another daemon's socket)."""
        listening = self._listener is not None
        await self._stop()
        self._refusals.flush()  # the count of refusals not logged yet
        if listening:
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)

    async def _stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        await self.connections.close()
        listener, own = self._listener, self._own
        self._listener = self._own = None
        if listener is not None:
            listener.close()
            release(self.path, own)

    # ------------------------------------------------------------------ one exchange

    async def _serve(self, connection: Connection) -> None:
        try:
            line = await self.connections.read_request(connection, b"\n", MAX_REQUEST_BYTES)
        except RequestTooLong:
            answer = self._refused(
                "too_long", f"a request is one line of at most {MAX_REQUEST_BYTES} bytes"
            )
        else:
            answer = await self._answer(line[:-1])
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.answer_timeout_s):
            await loop.sock_sendall(connection.sock, encode(answer))
            await self._finish(loop, connection.sock)

    @staticmethod
    async def _finish(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """End the answer, and read what the client sent past its request line (a closed
        socket with unread input resets the connection, and the answer would be lost) until
        it closes: within the answer's timeout."""
        sock.shutdown(socket.SHUT_WR)
        while await loop.sock_recv(sock, MAX_REQUEST_BYTES):
            pass

    def _refused(self, kind: str, reason: str) -> dict[str, Any]:
        """The answer to a request that is not one, logged at a bounded rate (``kind``: one
        of a fixed few, never the client's text)."""
        if self._refusals.admit("control.request.refused", category=kind, reason=reason):
            log.warning("control.request.refused", reason=reason)
        return {"ok": False, "error": reason}

    async def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            request = decode(line)
        except ValueError as exc:
            return self._refused("malformed", f"the request is {exc}")
        # Shielded: the handler finishes even if this connection is cancelled (the channel
        # closing waits for it through the connection's task).
        work = asyncio.ensure_future(self._handle(request))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait({work})
            failure = None if work.cancelled() else work.exception()
            if failure is not None:
                log.error("control.request.failed", error=error_reason(failure))
            raise
        except Exception:
            log.exception("control.request.failed", op=str(request.get("op"))[:40])
            return {"ok": False, "error": "the daemon failed to answer (see its log)"}

"""The HTTP/1.1 a Kubernetes client speaks to an API server, on asyncio streams: keep-alive
requests with Content-Length or chunked bodies, JSON answers, and chunked streams for watches.

Why not a library: the stand-in API server needs only this subset, the stdlib serves it in a
page, and a test tool for plugin authors should not pull a web framework into their venv
(aiohttp alone is 8 MB). No HTTP/2, no pipelining, no ``Expect: 100-continue``; clients fall
back from all three.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 3 * 1024 * 1024  # the API server's own request limit (3 MiB, maxRequestBodyBytes)


class ProtocolError(Exception):
    """The client broke HTTP/1.1; the connection is answered 400 and closed."""


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes
    target: str  # path and query as sent
    reader: asyncio.StreamReader = field(repr=False)

    def param(self, name: str) -> str | None:
        """The first value of query parameter ``name`` (as the API server reads them)."""
        values = self.query.get(name)
        return values[0] if values else None

    async def wait_disconnected(self) -> None:
        """Return when the client closes its side (what ends a watch it gave up)."""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while await self.reader.read(4096):
                pass


class Responder:
    """Writes one answer: either :meth:`send` once, or :meth:`start_stream` + :meth:`chunk`s +
    :meth:`end_stream`."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.status = 0

    async def send(
        self, status: int, body: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        self.status = status
        lines = [f"Content-Length: {len(body)}", *_header_lines(headers)]
        self._writer.write(_head(status, lines) + body)
        await self._writer.drain()

    async def start_stream(self, status: int, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        lines = ["Transfer-Encoding: chunked", *_header_lines(headers)]
        self._writer.write(_head(status, lines))
        await self._writer.drain()

    async def chunk(self, data: bytes) -> None:
        if data:
            self._writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            await self._writer.drain()

    async def end_stream(self) -> None:
        self._writer.write(b"0\r\n\r\n")
        await self._writer.drain()


Handler = Callable[[Request, Responder], Awaitable[None]]


def _header_lines(headers: Mapping[str, str] | None) -> list[str]:
    return [f"{name}: {value}" for name, value in (headers or {}).items()]


def _head(status: int, lines: list[str]) -> bytes:
    phrase = HTTPStatus(status).phrase
    return (
        f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{line}\r\n" for line in lines) + "\r\n"
    ).encode("latin-1")


async def serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler
) -> None:
    """Answer requests on one connection until the client closes it or asks to."""
    try:
        while True:
            try:
                request = await _read_request(reader)
            except ProtocolError as exc:
                await Responder(writer).send(400, str(exc).encode(), {"Connection": "close"})
                return
            if request is None:
                return
            await handler(request, Responder(writer))
            if request.headers.get("connection", "").lower() == "close":
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    line = await reader.readline()
    if not line:
        return None
    try:
        method, target, version = line.decode("latin-1").split()
    except ValueError:
        raise ProtocolError(f"bad request line {line[:80]!r}") from None
    if not version.startswith("HTTP/1."):
        raise ProtocolError(f"unsupported protocol {version!r}")
    headers: dict[str, str] = {}
    size = len(line)
    while True:
        line = await reader.readline()
        size += len(line)
        if size > MAX_HEADER_BYTES:
            raise ProtocolError("headers too large")
        if line in (b"\r\n", b"\n", b""):
            break
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise ProtocolError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    body = await _read_body(reader, headers)
    parts = urlsplit(target)
    return Request(
        method=method.upper(),
        path=parts.path,
        query=parse_qs(parts.query, keep_blank_values=True),
        headers=headers,
        body=body,
        target=target,
        reader=reader,
    )


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_line[:40]!r}") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers: none of ours matter
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise ProtocolError("request body too large")
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    length_text = headers.get("content-length", "0")
    try:
        length = int(length_text)
    except ValueError:
        raise ProtocolError(f"bad Content-Length {length_text!r}") from None
    if length < 0 or length > MAX_BODY_BYTES:
        raise ProtocolError("request body too large")
    return await reader.readexactly(length) if length else b""

"""``python -m devplug.testing kubelet DIR``: a kubelet stand-in to try ``devplug run`` against
(and ``mock-host``: a preset, :mod:`devplug.testing.mockhost`, or ``--from`` a record,
:mod:`devplug.testing.umockdev.replay`).

It serves a :class:`~devplug.testing.KubeletSimulator` in DIR, and the kubelet's pod
resources API beside it (``DIR/../pod-resources/kubelet.sock``, unless
``--no-pod-resources``), and prints, one line each, every registration (accepted or refused,
with the plugin's options) and every list a plugin sends. Lines typed on stdin ask what the
kubelet would ask:

- ``allocate RESOURCE ID [ID ...] [--pod NS/NAME] [--container NAME]``: Allocate for one
  container of a pod (default: a new ``default/pod-<n>``, container ``main``); prints the
  answer; the pod resources API lists the allocation from then on;
- ``release NS/NAME``: the pod ended; its devices are free again;
- ``pods``: what the pod resources API lists, one line per container;
- ``pin RESOURCE [ID ...]``, ``unpin RESOURCE``: GetAllocatableResources answers these ids
  for RESOURCE whatever its plugin lists (a kubelet out of step), or follows the lists again;
- ``preferred RESOURCE SIZE [MUST_INCLUDE ...]``: GetPreferredAllocation over every listed id;
- ``list``: the latest list of every registered resource;
- ``restart``: what a kubelet restart does to DIR (plugins re-register; allocations stay);
- ``help``; ``quit`` (or SIGINT/SIGTERM) stops and removes the sockets.

``--output json`` prints each line as a JSON object instead, for programs.

Everything a plugin sends (resource names, endpoints, device ids, health, answers, errors) is
printed escaped: a control character, a line break or a backslash shows as a Python-style
escape (``\\n``, ``\\x1b``, ``\\\\``), so a plugin cannot forge a line of its own or
drive the terminal. Typed lines may be of any length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from devplug._kits.printable import escaped
from devplug.model import ContainerAllocation
from devplug.testing.podresources import DEFAULT_CONTAINER, PodAllocation
from devplug.testing.simulator import (
    KubeletSimulator,
    ListedDevice,
    PluginSession,
    Registration,
    SimulatorRpcError,
)

COMMANDS = (
    "allocate RESOURCE ID [ID ...] [--pod NS/NAME] [--container NAME] | release NS/NAME | "
    "pods | pin RESOURCE [ID ...] | unpin RESOURCE | preferred RESOURCE SIZE [ID ...] | list | "
    "restart | quit"
)
READ_CHUNK_BYTES = 64 * 1024


class Console:
    """Prints what the simulator sees and runs the commands typed on stdin."""

    def __init__(self, kubelet: KubeletSimulator, output: str, out: TextIO = sys.stdout) -> None:
        self.kubelet = kubelet
        self.json = output == "json"
        self.out = out
        self.stopped = asyncio.Event()
        self._watchers: dict[int, asyncio.Task[None]] = {}

    def emit(self, text: str, **document: Any) -> None:
        """Print one line: ``text``, escaped, or the JSON document (escaped by JSON itself)."""
        if self.json:
            line = json.dumps({"event": document.pop("event"), **document})
        else:
            line = escaped(text)
        print(line, file=self.out, flush=True)

    # ------------------------------------------------------------------ what the kubelet sees

    async def follow_registrations(self) -> None:
        seen = 0
        while True:
            registrations = await self.kubelet.wait_for_registrations(seen + 1, timeout=None)
            for registration in registrations[seen:]:
                self._registered(registration)
            seen = len(registrations)

    def _registered(self, registration: Registration) -> None:
        if not registration.accepted:
            self.emit(
                f"refused {registration.resource}: {registration.error}",
                event="register.refused",
                resource=registration.resource,
                error=registration.error,
            )
            return
        session = self.kubelet.sessions.get(registration.resource)
        if session is None or id(session) in self._watchers:
            return
        options = session.options
        self.emit(
            f"registered {session.resource} ({session.endpoint.name}; preferred allocation: "
            f"{_yes(options.get_preferred_allocation_available)}, pre-start: "
            f"{_yes(options.pre_start_required)})",
            event="register.accepted",
            resource=session.resource,
            endpoint=session.endpoint.name,
            preferred_allocation=options.get_preferred_allocation_available,
            pre_start=options.pre_start_required,
        )
        self._watchers[id(session)] = asyncio.create_task(
            self._follow_lists(session), name=f"console-lists:{session.resource}"
        )

    async def _follow_lists(self, session: PluginSession) -> None:
        seen = 0
        while True:
            try:
                await session.wait_for_update(after=seen, timeout=None)
            except AssertionError:  # the stream ended
                self.emit(
                    f"{session.resource}: ListAndWatch ended ({session.stream_error or 'OK'})",
                    event="list.ended",
                    resource=session.resource,
                    error=session.stream_error,
                )
                return
            for listed in session.updates[seen:]:
                self._listed(session.resource, listed)
            seen = len(session.updates)

    def _listed(self, resource: str, listed: dict[str, ListedDevice]) -> None:
        devices = ", ".join(f"{d.id} {d.health}" for d in listed.values()) or "none"
        self.emit(
            f"{resource}: {len(listed)} devices: {devices}",
            event="list",
            resource=resource,
            devices=[
                {"id": d.id, "health": d.health, "numa_nodes": list(d.numa_nodes)}
                for d in listed.values()
            ],
        )

    # ------------------------------------------------------------------ what it asks

    async def run_command(self, line: str) -> None:
        words = line.split()
        if not words:
            return
        verb, args = words[0], words[1:]
        handlers: dict[str, Callable[[Sequence[str]], Any]] = {
            "allocate": self._allocate,
            "release": self._release,
            "pods": self._pods,
            "pin": self._pin,
            "unpin": self._unpin,
            "preferred": self._preferred,
            "list": self._list,
            "restart": self._restart,
        }
        if verb in ("quit", "exit"):
            self.stopped.set()
            return
        handler = handlers.get(verb)
        if handler is None:
            self.emit(f"commands: {COMMANDS}", event="help", commands=COMMANDS)
            return
        try:
            result = handler(args)
            if asyncio.iscoroutine(result):
                await result
        except SimulatorRpcError as exc:
            self.emit(f"error: {exc}", event="error", code=exc.code, details=exc.details)
        except (ValueError, LookupError) as exc:
            self.emit(f"error: {exc}", event="error", details=str(exc))
        except Exception as exc:
            # Whatever one command runs into, the console keeps taking the next ones (quit).
            details = f"{type(exc).__name__}: {exc}"
            self.emit(f"error: {verb} failed: {details}", event="error", details=details)

    def _session(self, resource: str) -> PluginSession:
        session = self.kubelet.sessions.get(resource)
        if session is None:
            known = ", ".join(sorted(self.kubelet.sessions)) or "none yet"
            raise LookupError(f"{resource} is not registered (registered: {known})")
        return session

    async def _allocate(self, args: Sequence[str]) -> None:
        words, options = _options(args, ("--pod", "--container"))
        if len(words) < 2:
            raise ValueError("allocate RESOURCE ID [ID ...] [--pod NS/NAME] [--container NAME]")
        made = await self.kubelet.allocate(
            words[0],
            words[1:],
            pod=options.get("--pod"),
            container=options.get("--container", DEFAULT_CONTAINER),
        )
        self.emit(_allocation_text(made), event="allocate", **_allocation(made))

    def _release(self, args: Sequence[str]) -> None:
        if len(args) != 1:
            raise ValueError("release NS/NAME")
        freed = self.kubelet.release(args[0])
        held = "; ".join(f"{r}: {' '.join(ids)}" for r, ids in sorted(freed.items()))
        self.emit(f"released {args[0]} ({held})", event="release", pod=args[0], devices=freed)

    def _pods(self, args: Sequence[str]) -> None:
        containers = [
            (f"{namespace}/{pod}/{container}", resources)
            for (namespace, pod), held in self.kubelet.pods.pods.items()
            for container, resources in held.items()
        ]
        if not containers:
            self.emit("pods: none hold devices", event="pods", containers=[])
            return
        for name, resources in containers:
            devices = {r: list(ids) for r, ids in resources.items()}
            text = "; ".join(f"{r} {' '.join(ids)}" for r, ids in devices.items())
            self.emit(f"{name}: {text}", event="pod", container=name, devices=devices)

    def _pin(self, args: Sequence[str]) -> None:
        if not args:
            raise ValueError("pin RESOURCE [ID ...]")
        self.kubelet.pin_allocatable(args[0], args[1:])
        ids = " ".join(args[1:]) or "none"
        self.emit(
            f"{args[0]}: allocatable pinned to {ids}",
            event="pin",
            resource=args[0],
            ids=list(args[1:]),
        )

    def _unpin(self, args: Sequence[str]) -> None:
        if len(args) != 1:
            raise ValueError("unpin RESOURCE")
        self.kubelet.pin_allocatable(args[0], None)
        self.emit(
            f"{args[0]}: allocatable follows its lists again", event="unpin", resource=args[0]
        )

    async def _preferred(self, args: Sequence[str]) -> None:
        if len(args) < 2 or not args[1].isdigit():
            raise ValueError("preferred RESOURCE SIZE [MUST_INCLUDE_ID ...]")
        session = self._session(args[0])
        ids = await session.preferred(list(session.latest), int(args[1]), list(args[2:]))
        self.emit(f"{args[0]}: preferred {' '.join(ids)}", event="preferred", ids=ids)

    def _list(self, args: Sequence[str]) -> None:
        for resource, session in sorted(self.kubelet.sessions.items()):
            self._listed(resource, session.latest)

    async def _restart(self, args: Sequence[str]) -> None:
        await self.kubelet.restart()
        self.emit(
            f"kubelet restarted: {self.kubelet.socket_path} is back; plugins must re-register",
            event="restarted",
        )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _options(args: Sequence[str], names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The words of a command, and the value of each option in ``names`` (``--pod X`` or
    ``--pod=X``) wherever it stands."""
    words: list[str] = []
    options: dict[str, str] = {}
    rest = iter(args)
    for word in rest:
        name, equals, value = word.partition("=")
        if name not in names:
            words.append(word)
            continue
        if not equals:
            value = next(rest, "")
        if not value:
            raise ValueError(f"{name} needs a value")
        options[name] = value
    return words, options


def _allocation(made: PodAllocation) -> dict[str, Any]:
    answer = made.answer
    return {
        "resource": made.resource,
        "ids": list(made.ids),
        "namespace": made.holder.namespace,
        "pod": made.holder.pod,
        "container": made.holder.container,
        "nodes": [
            {
                "host_path": n.host_path,
                "container_path": n.container_path,
                "permissions": n.permissions,
            }
            for n in answer.nodes
        ],
        "mounts": [
            {"host_path": m.host_path, "container_path": m.container_path, "read_only": m.read_only}
            for m in answer.mounts
        ],
        "env": dict(answer.env),
        "annotations": dict(answer.annotations),
        "cdi_devices": list(answer.cdi_devices),
    }


def _allocation_text(made: PodAllocation) -> str:
    answer: ContainerAllocation = made.answer
    parts = [f"{made.resource}: allocated to {made.holder}"]
    if answer.nodes:
        parts.append("nodes " + " ".join(f"{n.host_path}:{n.permissions}" for n in answer.nodes))
    if answer.mounts:
        parts.append("mounts " + " ".join(m.host_path for m in answer.mounts))
    if answer.env:
        parts.append("env " + " ".join(f"{k}={v}" for k, v in sorted(answer.env.items())))
    if answer.cdi_devices:
        parts.append("cdi " + " ".join(answer.cdi_devices))
    return "; ".join(parts)


async def _read_lines(console: Console) -> None:
    """Commands from stdin, lines of any length; at its end, keep serving until a signal.

    Not ``StreamReader.readline``: it gives up on a line longer than the reader's limit (64 KiB
    by default) with an error that ends the loop, and an ``allocate`` of thousands of ids is
    longer than that.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    try:
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    except (OSError, ValueError):  # stdin closed, or a file that cannot be watched
        return
    partial: list[bytes] = []  # the line read so far, in chunks (joined once, when it ends)
    while chunk := await reader.read(READ_CHUNK_BYTES):
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            partial.append(chunk[start:end])
            line = b"".join(partial)
            partial.clear()
            start = end + 1
            await console.run_command(line.decode(errors="replace"))
        partial.append(chunk[start:])
    if any(partial):  # a last line without its newline
        await console.run_command(b"".join(partial).decode(errors="replace"))


async def serve_console(directory: Path, output: str, pod_resources: bool = True) -> None:
    async with KubeletSimulator(directory, pod_resources=pod_resources) as kubelet:
        console = Console(kubelet, output)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, console.stopped.set)
        lister = kubelet.pod_resources_socket
        also = "" if lister is None else f" and {lister}"
        console.emit(
            f"kubelet: serving {kubelet.socket_path}{also}; waiting for plugins "
            "(type 'help' for the commands)",
            event="serving",
            socket=str(kubelet.socket_path),
            pod_resources_socket=None if lister is None else str(lister),
        )
        tasks = [
            asyncio.create_task(console.follow_registrations(), name="console-registrations"),
            asyncio.create_task(_read_lines(console), name="console-stdin"),
        ]
        try:
            await console.stopped.wait()
        finally:
            for task in [*tasks, *console._watchers.values()]:
                task.cancel()
            for task in [*tasks, *console._watchers.values()]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def build_parser() -> argparse.ArgumentParser:
    from devplug.testing.mockhost import PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m devplug.testing",
        description="devplug's test tools, from the command line.",
        epilog="exit status: 0 success; 1 failure; 2 bad usage",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    kubelet = sub.add_parser(
        "kubelet",
        help="serve a kubelet stand-in in DIR; print what plugins register and list",
        description="Serve a kubelet stand-in in DIR and print what plugins register and list. "
        f"Commands on stdin: {COMMANDS}.",
        epilog="exit status: 0 stopped by quit, SIGINT or SIGTERM; 2 bad usage",
    )
    kubelet.add_argument("dir", type=Path, help="the device plugin dir to serve kubelet.sock in")
    kubelet.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="default text"
    )
    kubelet.add_argument(
        "--no-pod-resources",
        action="store_true",
        help="do not serve the pod resources API (DIR/../pod-resources/kubelet.sock), as an "
        "old kubelet, or a pod without its mount",
    )
    mock = sub.add_parser(
        "mock-host",
        help="build a umockdev mock host in DIR (run programs with UMOCKDEV_DIR=DIR "
        "umockdev-wrapper ...)",
        description="Build one of the README's mock hosts, or a recorded host, in DIR: "
        "programs run under umockdev-wrapper with UMOCKDEV_DIR=DIR see its hardware.",
        epilog="exit status: 0 built; 1 DIR is not empty, or FILE cannot be read or loaded; "
        "2 bad usage",
    )
    mock.add_argument("dir", type=Path, help="a new or empty directory")
    source = mock.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS))
    source.add_argument(
        "--from",
        dest="record",
        type=Path,
        metavar="FILE",
        help="the host a record describes ('devplug capture', or umockdev-record)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "mock-host":
        from devplug.testing.mockhost import build_mock_host
        from devplug.testing.umockdev import host_from_record

        directory = args.dir.absolute()
        try:
            if args.record is not None:
                host_from_record(directory, args.record)
            else:
                build_mock_host(directory, args.preset)
        except FileExistsError as exc:
            print(f"python -m devplug.testing: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            where = exc.filename or args.record
            print(f"python -m devplug.testing: {where}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # RecordError: the line and what is wrong with it
            print(f"python -m devplug.testing: {exc}", file=sys.stderr)
            return 1
        print(f"UMOCKDEV_DIR={directory}")
        return 0
    asyncio.run(serve_console(args.dir.absolute(), args.output, not args.no_pod_resources))
    return 0

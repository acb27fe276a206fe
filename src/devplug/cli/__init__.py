"""Command line: ``devplug run | scan | capture | cdi generate | dra deviceclasses | status |
cordon | uncordon | version``, and the same command line for a plugin author's own entry point
(:func:`serve`).

May use every room below it: the composition (:mod:`devplug.plugin`), the fronts its commands
run (``scan``, ``cdi generate``, ``dra deviceclasses``, ``status``) or talk to (``cordon``,
``uncordon``: the daemon's control channel), the scanners, config, the
model and the kits, and the test tools' umockdev testbeds (:mod:`devplug.testing.umockdev`),
which ``capture`` writes records for and ``scan --replay`` builds. grpc and protobuf only in
the status client (:mod:`.status`), which asks the kubelet-facing sockets what is registered;
``status --pods`` (:mod:`.holders`) reads the pod resources API through
:mod:`devplug.kubelet.podresources`, which hands back plain values.

Exit status: 0 success, 2 bad usage or configuration (nothing was served), 130 interrupted
(Ctrl-C), 141 stdout's reader went away (``devplug status | head -1``: quietly, as a command
that SIGPIPE ends), 1 anything else. Flags may come before the command
(:mod:`devplug.cli.early`).

Start-up is kept short: ``version`` and ``--version`` are answered before anything else loads,
``--help`` needs only the parser (the scanners' names, not their modules), and the commands
with their settings (pydantic, YAML), logging (structlog) and daemon load after the command
line is parsed. ``run`` first guards its signals (:func:`devplug.plugin.guard_signals`): a
SIGHUP while the rest loads is a reload request, not the end of the process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from devplug._kits.lazy import lazy_names
from devplug.cli import early
from devplug.plugin import EXIT_INTERRUPTED

if TYPE_CHECKING:
    from devplug.cli.commands import ScannerFactory
    from devplug.cli.parser import build_parser

__all__ = ["ScannerFactory", "build_parser", "main", "serve"]

# 128 + SIGPIPE: what a shell reports for a command that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141

__getattr__, __dir__ = lazy_names(
    __name__, {"ScannerFactory": "devplug.cli.commands", "build_parser": "devplug.cli.parser"}
)


def main(
    argv: Sequence[str] | None = None,
    *,
    scanners: Mapping[str, ScannerFactory] | None = None,
    program: str = "devplug",
    version: str | None = None,
    description: str | None = None,
) -> int:
    """Run one command and return its exit status.

    ``scanners`` (config name -> factory) are the scanners this command line offers, in place
    of devplug's built-in ones: a plugin author's entry point gets every command (``run``,
    ``scan``, ``cdi generate``, ``status``), the settings flags and environment, and its
    sections validated by its own factories. ``program``, ``version`` and ``description`` are
    what ``--version`` and ``--help`` say (None: devplug's).

    Without ``argv`` (the process's own command line: the console script, ``python -m
    devplug``, :func:`serve`), ``run`` holds the signals from here on; a call with ``argv``
    (a test, an embedding program) leaves the process's handlers alone until it serves.
    Ctrl-C ends any command with status 130 and no traceback (``run``, once it serves, stops
    in order on SIGINT instead: status 0); SIGTERM or SIGQUIT before ``run`` serves ends it
    with 0.
    """
    own = argv is None
    argv = early.hoist(sys.argv[1:] if argv is None else argv)
    try:
        try:
            if own and early.command(argv) == "run":
                from devplug.plugin import guard_signals, pause_gc, resume_gc

                guard_signals()  # first: until now a SIGHUP's default action kills the process
                pause_gc()  # while the daemon's modules import (resumed before it scans)
                try:
                    return _main(argv, scanners, program, version, description)
                finally:
                    resume_gc()  # if the daemon never ran (a refused config, say)
            return _main(argv, scanners, program, version, description, own=own)
        finally:
            # Written out here rather than at the interpreter's exit (--help's text too), so
            # that a reader that went away is met below.
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt as interrupted:
        # The shell shows the ^C; a traceback of where the command happened to be is noise.
        # A stop signal before ``run`` served comes the same way (devplug.plugin.StopSignalled),
        # with its own status: 0 for SIGTERM.
        return getattr(interrupted, "exit_status", EXIT_INTERRUPTED)


def _reader_gone() -> int:
    """stdout's reader went away: end quietly. Python ignores SIGPIPE, so a write failed
    instead of the process ending; stdout now leads to /dev/null, so that the interpreter's
    own flush at exit has nothing to fail on (the recipe of Python's signal module docs,
    "Note on SIGPIPE")."""
    with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def _main(
    argv: list[str],
    scanners: Mapping[str, ScannerFactory] | None,
    program: str,
    version: str | None,
    description: str | None,
    *,
    own: bool = False,
) -> int:
    if argv in (["version"], ["--version"]):
        print(early.version_line(program, version))
        return 0
    from devplug.cli.parser import EXIT_FAILED, EXIT_USAGE, build_parser

    factories = _factories(scanners)
    args = build_parser(program, factories, version=version, description=description).parse_args(
        argv
    )
    if args.command == "version":
        print(early.version_line(program, version))
        return 0
    if getattr(args, "replay", None) is not None:
        from devplug.cli.replay import need_preload

        # Before anything loads: the command may start again under umockdev's preload.
        problem = need_preload(program, may_restart=own)
        if problem is not None:
            print(f"{program}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "status":
        from devplug.cli.status import status_command

        return status_command(
            args.kubelet_dir,
            args.output,
            args.timeout,
            pods=args.pods or args.pod_resources_socket is not None,
            pod_resources_socket=args.pod_resources_socket,
        )
    if args.command in ("cordon", "uncordon"):
        from devplug.cli.cordon import cordon_command, uncordon_command

        if args.command == "cordon":
            return cordon_command(
                program, args.kubelet_dir, args.resource, args.device_id, args.reason, args.timeout
            )
        return uncordon_command(
            program, args.kubelet_dir, args.resource, args.device_id, args.timeout
        )
    if args.command == "dra":
        from devplug.cli.dra import deviceclasses_main

        return deviceclasses_main(program, args.config, args.output)
    from devplug._kits.pydantic_plugins import no_plugin_discovery
    from devplug.errors import ConfigError

    # The settings models (devplug's and the configured scanners') are built here: without
    # pydantic's plugin discovery, which costs the start-up more than any of them.
    with no_plugin_discovery():
        from devplug.cli import commands

        try:
            settings, built = commands.prepare(args, factories)
        except ConfigError as exc:
            commands.fail(program, f"configuration error: {exc}")
            return EXIT_USAGE
        except Exception:
            # A bug (in a plugin's factory, say), not a wrong config: the traceback is what
            # its author needs.
            commands.fail(program, "cannot start: loading the configuration failed")
            import traceback

            traceback.print_exc()
            return EXIT_FAILED
    if args.command == "cdi":
        return commands.cdi_generate(program, settings, built, args)
    if args.command == "capture":
        from devplug.cli.capture import capture

        return capture(program, built, args.output, args.keep)
    if args.command == "scan" and args.replay is not None:
        from devplug.cli.replay import scan_replayed

        return scan_replayed(program, built, args.output, args.replay)
    if args.command == "scan" or args.dry_run:
        return commands.scan(program, built, args.output)
    return commands.run(program, settings, built, args, factories)


def _factories(scanners: Mapping[str, ScannerFactory] | None) -> Mapping[str, ScannerFactory]:
    """The scanners offered: a plugin's own, or devplug's built-in ones (each module loaded
    when a command builds that scanner, so only the configured ones load)."""
    if scanners is None:
        from devplug.scanners.registry import BUILTIN_SCANNERS

        return BUILTIN_SCANNERS
    from devplug.config.scanner_names import scanner_name_problem

    for name in scanners:
        problem = scanner_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
    return scanners


def serve(
    scanners: Mapping[str, ScannerFactory],
    *,
    program: str,
    version: str,
    description: str | None = None,
    argv: Sequence[str] | None = None,
) -> int:
    """A plugin author's entry point: devplug's command line, as ``program``, with only the
    author's ``scanners``.

    ``scanners`` maps config section names (snake_case, as config keys) to factories ``(raw
    section, field) -> Scanner`` (``MyScanner.from_config``). ``program``, ``version`` and
    ``description`` are the plugin's own: its name in messages and ``--help``, and what
    ``--version`` prints (``misc-plugin 1.2.0 (devplug 0.1.0)``). ``argv`` defaults to
    ``sys.argv[1:]`` (and then ``run`` guards the signals first, as ``devplug run`` does).
    Returns the exit status. To offer devplug's built-in scanners as well, pass
    ``devplug.with_builtins(scanners)``.
    """
    return main(argv, scanners=scanners, program=program, version=version, description=description)


if __name__ == "__main__":
    sys.exit(main())

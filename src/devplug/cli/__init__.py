"""Command line: ``devplug run | scan | cdi generate | status | version``, and the same command
line for a plugin author's own entry point (:func:`serve`).

Exit status: 0 success, 2 bad usage or configuration (nothing was served), 1 anything else.

Start-up is kept short: ``version`` and ``--version`` are answered before anything else loads,
``--help`` needs only the parser (the scanners' names, not their modules), and the commands
with their settings (pydantic, YAML), logging (structlog) and daemon load after the command
line is parsed. ``run`` first guards its signals (:func:`devplug.plugin.guard_signals`): a
SIGHUP while the rest loads is a reload request, not the end of the process.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from devplug._version import __version__

if TYPE_CHECKING:
    from devplug.cli.commands import ScannerFactory
    from devplug.cli.parser import build_parser
    from devplug.plugin import Loader

__all__ = ["ScannerFactory", "build_parser", "main", "serve"]

_LAZY = {"ScannerFactory": "devplug.cli.commands", "build_parser": "devplug.cli.parser"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'devplug.cli' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def _command(argv: Sequence[str]) -> str | None:
    """The command word: the first argument that is not an option (the top-level options,
    ``--help`` and ``--version``, take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(
    argv: Sequence[str] | None = None,
    *,
    scanners: Mapping[str, ScannerFactory] | None = None,
    program: str = "devplug",
) -> int:
    """Run one command and return its exit status.

    ``scanners`` adds scanner factories by config name to the built-in ones: a plugin author's
    entry point gets every command (``run``, ``scan``, ``cdi generate``, ``status``), the
    settings flags and environment, and its sections validated by its own factories.

    Without ``argv`` (the process's own command line: the console script, ``python -m
    devplug``, :func:`serve`), ``run`` holds the signals from here on; a call with ``argv``
    (a test, an embedding program) leaves the process's handlers alone until it serves.
    """
    if argv is None:
        argv = sys.argv[1:]
        if _command(argv) == "run":
            from devplug.plugin import guard_signals, pause_gc, resume_gc

            guard_signals()  # first: until now a SIGHUP's default action kills the process
            pause_gc()  # while the daemon's modules import (resumed before it scans)
            try:
                return _main(argv, scanners, program)
            finally:
                resume_gc()  # if the daemon never ran (a refused config, say)
    return _main(argv, scanners, program)


def _main(argv: Sequence[str], scanners: Mapping[str, ScannerFactory] | None, program: str) -> int:
    argv = list(argv)
    if argv in (["version"], ["--version"]):
        print(f"{program} {__version__}")
        return 0
    from devplug.cli.parser import EXIT_USAGE, build_parser
    from devplug.scanners.registry import with_builtins

    # Looked up by name when a command builds its scanners: only those configured load.
    factories = with_builtins(scanners)
    args = build_parser(program, factories).parse_args(argv)
    if args.command == "version":
        print(f"{program} {__version__}")
        return 0
    if args.command == "status":
        from devplug.cli.status import status_command

        return status_command(args.kubelet_dir, args.output, args.timeout)
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
    if args.command == "cdi":
        return commands.cdi_generate(program, settings, built, args)
    if args.command == "scan" or args.dry_run:
        return commands.scan(program, built, args.output)
    return commands.run(program, settings, built, args, factories)


def serve(
    scanners: Mapping[str, ScannerFactory] | Loader,
    *,
    program: str = "devplug",
    argv: Sequence[str] | None = None,
) -> int:
    """A plugin author's entry point: devplug's command line with ``scanners`` added.

    ``scanners`` maps config section names to factories ``(raw section, field) -> Scanner``
    (``MyScanner.from_config``); ``argv`` defaults to ``sys.argv[1:]`` (and then ``run``
    guards the signals first, as ``devplug run`` does). Returns the exit status. The older
    form, a function returning ``(settings, scanners)``, still serves without a command line
    (see :func:`devplug.plugin.serve`).
    """
    if callable(scanners):
        from devplug.plugin import serve as serve_loader

        return serve_loader(scanners, program=program)
    return main(argv, scanners=scanners, program=program)


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``devplug run | scan | cdi generate | status | version``, and the same command
line for a plugin author's own entry point (:func:`serve`).

Exit status: 0 success, 2 bad usage or configuration (nothing was served), 1 anything else.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from devplug import __version__
from devplug.cli import commands
from devplug.cli.commands import ScannerFactory
from devplug.cli.parser import EXIT_USAGE, build_parser
from devplug.errors import ConfigError

__all__ = ["ScannerFactory", "build_parser", "main", "serve"]


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
    """
    from devplug.scanners.registry import BUILTIN_SCANNERS

    factories: dict[str, ScannerFactory] = {**BUILTIN_SCANNERS, **(scanners or {})}
    args = build_parser(program, factories).parse_args(argv)
    if args.command == "version":
        print(f"{program} {__version__}")
        return 0
    if args.command == "status":
        from devplug.cli.status import status_command

        return status_command(args.kubelet_dir, args.output, args.timeout)
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
    scanners: Mapping[str, ScannerFactory] | commands.Loader,
    *,
    program: str = "devplug",
    argv: Sequence[str] | None = None,
) -> int:
    """A plugin author's entry point: devplug's command line with ``scanners`` added.

    ``scanners`` maps config section names to factories ``(raw section, field) -> Scanner``
    (``MyScanner.from_config``); ``argv`` defaults to ``sys.argv[1:]``. Returns the exit
    status. The older form, a function returning ``(settings, scanners)``, still serves without
    a command line (see :func:`devplug.plugin.serve`).
    """
    if callable(scanners):
        from devplug.plugin import serve as serve_loader

        return serve_loader(scanners, program=program)
    return main(sys.argv[1:] if argv is None else argv, scanners=scanners, program=program)


if __name__ == "__main__":
    sys.exit(main())

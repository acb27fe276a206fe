"""Serving scanners as a device plugin daemon: what ``devplug run`` does, for an entry point of
a plugin author's own (``devplug run`` knows only the built-in scanners).

The daemon itself (and with it gRPC) is imported when :func:`serve` runs, so that importing
:mod:`devplug` stays light for scanners and their tests.
"""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from collections.abc import Callable, Sequence

import structlog

from devplug.config import Settings
from devplug.errors import ConfigError
from devplug.logconfig import configure
from devplug.scanners.base import Scanner

EXIT_CONFIG = 2  # bad usage or configuration: nothing was served

# Reads the configuration and builds the scanners; raises ConfigError naming the bad field.
# Called at start and again on every SIGHUP.
Loader = Callable[[], tuple[Settings, Sequence[Scanner]]]


def serve(load: Loader, *, program: str = "devplug") -> int:
    """Load the configuration, configure logging, and serve until SIGTERM or SIGINT; SIGHUP
    calls ``load`` again and applies the result (a refused one keeps the running config).

    Returns the exit status: 0 after an orderly stop, 2 for a configuration error (printed to
    stderr as ``<program>: configuration error: ...``; nothing was served), 1 if ``load``
    raised anything else (its traceback on stderr) or the daemon crashed (logged).
    """
    try:
        settings, scanners = load()
    except ConfigError as exc:
        print(f"{program}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception:
        # A bug in the loader, not a wrong config: the traceback is what its author needs
        # (logging is not configured yet).
        print(f"{program}: cannot start: loading the configuration failed", file=sys.stderr)
        traceback.print_exc()
        return 1
    configure(settings.log_format, settings.log_level)
    return run_daemon(settings, scanners, load, program=program)


def run_daemon(
    settings: Settings,
    scanners: Sequence[Scanner],
    reload_config: Loader | None = None,
    *,
    program: str = "devplug",
) -> int:
    """Serve ``scanners`` with ``settings`` (logging already configured); see :func:`serve`."""
    # grpc's C core logs to stderr on its own; keep its informational lines out of our JSON.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from devplug.daemon import Daemon, run_until_signalled

    async def main() -> None:
        daemon = Daemon(settings, scanners, freeze_gc=True, config_loader=reload_config)
        await run_until_signalled(daemon)

    try:
        asyncio.run(main())
    except Exception as exc:
        refused = _config_error_in(exc)
        if refused is not None:
            print(f"{program}: configuration error: {refused}", file=sys.stderr)
            return EXIT_CONFIG
        structlog.get_logger("devplug.daemon").exception("daemon.crashed")
        return 1
    return 0


def _config_error_in(exc: BaseException) -> ConfigError | None:
    """The ConfigError that stopped the daemon (its task group wraps errors in groups)."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _config_error_in(inner)
            if found is not None:
                return found
    return None

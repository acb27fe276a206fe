"""What ``run``, ``scan`` and ``cdi generate`` do: settings from their sources, scanners from
their factories, then serve, print or write. Every function returns an exit status."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from devplug.cli.parser import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from devplug.config import ENV_PREFIX, SCALAR_KEYS, Settings, env_scanners, load_settings
from devplug.config.scanner_names import log_respellings, scanner_name
from devplug.errors import CdiSpecError, ConfigError
from devplug.logconfig import configure
from devplug.naming import MAX_UNIX_SOCKET_PATH, short_socket_file_name
from devplug.scanners.base import Scanner
from devplug.scanners.generic import GenericScanner

# A scanner's factory: (its raw config section or None for the defaults, the section's dotted
# field for errors) -> the scanner, raising ConfigError naming the bad field.
ScannerFactory = Callable[[Any, str], Scanner]

__all__ = ["ScannerFactory"]

# Where udevd keeps the properties its rules add (ID_VENDOR_ID, ID_PATH, ...).
UDEV_DATABASE = Path("/run/udev/data")

log = structlog.get_logger(__name__)


def fail(program: str, message: str) -> None:
    print(f"{program}: {message}", file=sys.stderr)


def load(args: argparse.Namespace, factories: Mapping[str, ScannerFactory]) -> Settings:
    """The settings from file, environment and the flags this command has."""
    config, source = args.config, "--config"
    if config is None and os.environ.get("DEVPLUG_CONFIG"):
        config, source = Path(os.environ["DEVPLUG_CONFIG"]), "DEVPLUG_CONFIG"
    _check_scanner_names(args.scanner, factories)
    flags = {key: getattr(args, key, None) for key in SCALAR_KEYS}
    return load_settings(config, flags, args.scanner, config_source=source)


def _check_scanner_names(
    from_flags: Sequence[str], factories: Mapping[str, ScannerFactory]
) -> None:
    known = ", ".join(sorted(factories))
    for source, names in (("DEVPLUG_SCANNER", env_scanners(os.environ)), ("--scanner", from_flags)):
        for name in names:
            if scanner_name(name) not in factories:
                raise ConfigError(source, f"unknown scanner {name!r}; known scanners: {known}")


def build(settings: Settings, factories: Mapping[str, ScannerFactory]) -> list[Scanner]:
    """One scanner per configured section; an unknown section lists the known scanners."""
    scanners: list[Scanner] = []
    for name, raw in settings.scanners.items():
        factory = factories.get(name)
        if factory is None:
            known = ", ".join(sorted(factories))
            raise ConfigError(f"scanners.{name}", f"unknown scanner; known scanners: {known}")
        scanners.append(factory(raw, f"scanners.{name}"))
    if not scanners:
        raise ConfigError(
            "scanners",
            "no scanner configured: pass --scanner NAME or add a 'scanners:' section to the "
            f"config file (known scanners: {', '.join(sorted(factories))})",
        )
    return scanners


def prepare(
    args: argparse.Namespace, factories: Mapping[str, ScannerFactory]
) -> tuple[Settings, list[Scanner]]:
    """Settings, logging and scanners; ConfigError for anything that would not serve."""
    settings = load(args, factories)
    configure(settings.log_format, settings.log_level)
    warn_unknown_environment()
    log_respellings(settings.scanner_respellings)
    scanners = build(settings, factories)
    if args.command == "run":
        check_dirs(settings)
    return settings, scanners


def check_dirs(settings: Settings) -> None:
    """The daemon's dirs: directories where they exist, and short enough for socket paths."""
    dirs = [("kubelet_dir", settings.kubelet_dir)]
    if settings.cdi.enabled:
        dirs.append(("cdi.dir", settings.cdi.dir))
    for field, path in dirs:
        if path.exists() and not path.is_dir():
            raise ConfigError(field, f"{path} is not a directory")
    shortest = settings.kubelet_dir / short_socket_file_name("x/y")
    if len(os.fsencode(shortest)) > MAX_UNIX_SOCKET_PATH:
        raise ConfigError(
            "kubelet_dir",
            f"{settings.kubelet_dir} is too long: socket paths in it would exceed the "
            f"{MAX_UNIX_SOCKET_PATH}-byte unix socket limit; use a shorter directory",
        )


def warn_unknown_environment() -> None:
    """A misspelt DEVPLUG_* variable would otherwise be ignored without a word."""
    known = {ENV_PREFIX + key.upper() for key in SCALAR_KEYS} | {
        "DEVPLUG_CONFIG",
        "DEVPLUG_SCANNER",
        "DEVPLUG_TESTS_WITHOUT_UMOCKDEV",
    }
    unknown = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        log.warning("config.env.unknown", variables=unknown, known=sorted(known))


def scan(program: str, scanners: Sequence[Scanner], output: str, *, replayed: bool = False) -> int:
    """Print the tree on stdout (what the scanners that worked found); on stderr, each failed
    scanner and why, and "no devices found" only when every scanner ran and found nothing.
    Status 1 when a scanner failed or two produced one resource. ``replayed``: the host is a
    record (``--replay``), whose properties are there whatever this machine's udev has."""
    from devplug.cli.report import render
    from devplug.hotplug.scanning import ScanRunner

    try:
        result = ScanRunner(scanners).scan_blocking()
    except ConfigError as exc:
        fail(program, f"configuration error: {exc}")
        return EXIT_USAGE
    sys.stdout.write(render(result.tree, output, result.extras))
    warn_unmatched(scanners, result.tree, udev_database=True if replayed else None)
    status = EXIT_OK
    for resource, losers in sorted(result.conflicts.items()):
        fail(
            program,
            f"{resource} is produced by more than one scanner; served from "
            f"{result.owners[resource].name}, not from {', '.join(losers)}",
        )
        status = EXIT_FAILED
    if scanners_failed(program, result.failure_reasons):
        status = EXIT_FAILED
    elif not result.tree and output == "table":
        # As kubectl's "No resources found": a message, so on stderr.
        print("no devices found", file=sys.stderr)
    return status


def scanners_failed(program: str, reasons: Mapping[str, str]) -> bool:
    """Say which scanners failed and why; whether any did."""
    for name, reason in reasons.items():
        fail(program, f"scanner {name} failed: {reason}")
    return bool(reasons)


def warn_unmatched(
    scanners: Sequence[Scanner], tree: Mapping[str, object], *, udev_database: bool | None = None
) -> None:
    """Generic entries that found nothing, and property matches udev's database cannot back
    (``udev_database``: whether its properties are known; None: whether UDEV_DATABASE is)."""
    if udev_database is None:
        udev_database = UDEV_DATABASE.is_dir()
    for scanner in scanners:
        if not isinstance(scanner, GenericScanner):
            continue
        for entry in scanner.entries:
            if entry.resource not in tree:
                log.warning(
                    "scan.entry.unmatched",
                    resource=entry.resource,
                    match=entry.match.model_dump(exclude_defaults=True),
                )
            if entry.match.properties and not udev_database:
                log.warning(
                    "scan.udev_database.missing",
                    resource=entry.resource,
                    properties=sorted(entry.match.properties),
                    reason=f"{UDEV_DATABASE} does not exist: udevd's properties (ID_*) are not "
                    "known here, so this match can find nothing",
                )


def cdi_generate(
    program: str,
    settings: Settings,
    scanners: Sequence[Scanner],
    args: argparse.Namespace,
) -> int:
    from devplug.cdi.generate import (
        STATIC_CDI_DIR,
        config_identity,
        specs_text,
        tree_specs,
        write_tree_specs_blocking,
    )
    from devplug.cdi.sync import default_instance
    from devplug.hotplug.scanning import ScanRunner

    if args.cdi_dir is not None:
        fail(
            program,
            "configuration error: cdi generate writes to --output-dir (default /etc/cdi), not "
            "to --cdi-dir, the directory the daemon manages",
        )
        return EXIT_USAGE
    if os.environ.get(ENV_PREFIX + "CDI_DIR"):
        # Refused, not ignored: whoever set it expects the specs there, not in /etc/cdi.
        fail(
            program,
            f"configuration error: {ENV_PREFIX}CDI_DIR is set, but cdi generate writes to "
            "--output-dir (default /etc/cdi), never to the daemon's directory: unset it for "
            "this command",
        )
        return EXIT_USAGE
    output = "json" if args.stdout else args.output
    instance = settings.cdi.instance or default_instance(scanners)
    directory = args.output_dir or STATIC_CDI_DIR
    try:
        result = ScanRunner(scanners).scan_blocking()
        if scanners_failed(program, result.failure_reasons):
            # Specs from the others alone would be short of the failed scanner's resources
            # (and --prune would delete theirs).
            fail(program, "nothing written or printed")
            return EXIT_FAILED
        specs = tree_specs(result.tree, settings.cdi.kinds)
        if output is not None:
            sys.stdout.write(_specs_document(specs_text(specs), output))
            return EXIT_OK
        config = args.config or (
            Path(os.environ["DEVPLUG_CONFIG"]) if os.environ.get("DEVPLUG_CONFIG") else None
        )
        written, removed = write_tree_specs_blocking(
            directory, specs, instance, prune=args.prune, config=config_identity(config)
        )
    except (ConfigError, CdiSpecError) as exc:
        fail(program, f"configuration error: {exc}")
        return EXIT_USAGE
    except FileExistsError as exc:  # ForeignSpecError, SpecHeldError: someone else's file
        fail(program, str(exc.strerror or exc))
        return EXIT_FAILED
    except OSError as exc:
        fail(program, f"cannot write specs to {directory}: {exc.strerror or exc}")
        return EXIT_FAILED
    for name in written:
        print(f"wrote {directory / name}")
    for name in removed:
        print(f"removed {directory / name} (devplug's, for a resource this host no longer has)")
    if not written:
        print(f"no devices found: nothing written to {directory}", file=sys.stderr)
    return EXIT_OK


def _specs_document(json_text: str, output: str) -> str:
    if output == "json":
        return json_text
    import json

    import yaml

    return yaml.safe_dump(json.loads(json_text), sort_keys=False)


def run(
    program: str,
    settings: Settings,
    scanners: Sequence[Scanner],
    args: argparse.Namespace,
    factories: Mapping[str, ScannerFactory],
) -> int:
    from devplug.plugin import run_daemon

    def reload_config() -> tuple[Settings, Sequence[Scanner]]:
        """SIGHUP: the same file, flags and environment, read again and validated."""
        fresh = load(args, factories)
        scanners = build(fresh, factories)
        log_respellings(fresh.scanner_respellings)
        return fresh, scanners

    return run_daemon(settings, scanners, reload_config, program=program)

"""Command line: ``devplug run | scan | cdi generate | status | version``.

Exit status: 0 success, 2 bad usage or configuration (nothing was served), 1 anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from devplug import __version__
from devplug.config import ENV_PREFIX, SCALAR_KEYS, Settings, load_settings
from devplug.errors import CdiSpecError, ConfigError
from devplug.logconfig import configure
from devplug.naming import MAX_UNIX_SOCKET_PATH, short_socket_file_name
from devplug.plugin import EXIT_CONFIG, run_daemon
from devplug.scanners.base import Scanner
from devplug.scanners.registry import BUILTIN_SCANNERS, build_scanners


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("settings (each also DEVPLUG_<FLAG> and a config file key)")
    group.add_argument("--config", type=Path, help="YAML config file (env DEVPLUG_CONFIG)")
    group.add_argument(
        "--scanner",
        action="append",
        default=[],
        metavar="NAME",
        help="add a built-in scanner with its defaults; repeatable "
        f"({', '.join(sorted(n.replace('_', '-') for n in BUILTIN_SCANNERS))})",
    )
    group.add_argument(
        "--kubelet-dir",
        type=Path,
        help="device plugin dir (default /var/lib/kubelet/device-plugins)",
    )
    group.add_argument("--cdi-dir", type=Path, help="CDI spec dir (default /var/run/cdi)")
    group.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="default: console on a terminal, json otherwise",
    )
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    group.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help="serve /metrics, /healthz and /readyz here (default: off)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="devplug", description="Kubernetes device plugin daemon")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options()
    run = sub.add_parser("run", parents=[common], help="serve devices to the kubelet")
    run.add_argument(
        "--dry-run", action="store_true", help="print the device tree and exit (as 'scan')"
    )
    run.add_argument(
        "--output", choices=["table", "json", "yaml"], default="table", help="with --dry-run"
    )
    scan = sub.add_parser("scan", parents=[common], help="print the device tree and exit (dry run)")
    scan.add_argument("--output", "-o", choices=["table", "json", "yaml"], default="table")
    cdi = sub.add_parser("cdi", help="CDI spec files")
    cdi_sub = cdi.add_subparsers(dest="cdi_command", required=True, metavar="ACTION")
    generate = cdi_sub.add_parser(
        "generate",
        parents=[common],
        help="scan once and write (or print) the CDI specs, without serving",
    )
    where = generate.add_mutually_exclusive_group()
    where.add_argument(
        "--output-dir", type=Path, default=None, help="write the specs here (default /etc/cdi)"
    )
    where.add_argument(
        "--stdout", action="store_true", help="print the specs as one JSON object instead"
    )
    generate.add_argument(
        "--prune",
        action="store_true",
        help="also delete specs this config's devplug wrote there before for resources the "
        "host no longer has",
    )
    status = sub.add_parser(
        "status", help="ask every device plugin in the kubelet dir what it serves (any vendor's)"
    )
    status.add_argument(
        "--kubelet-dir",
        type=Path,
        help="device plugin dir (default $DEVPLUG_KUBELET_DIR or /var/lib/kubelet/device-plugins)",
    )
    status.add_argument("--output", "-o", choices=["table", "json"], default="table")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds per plugin")
    sub.add_parser("version", help="print the version")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    config = args.config
    if config is None and os.environ.get("DEVPLUG_CONFIG"):
        config = Path(os.environ["DEVPLUG_CONFIG"])
    flags = {
        "kubelet_dir": args.kubelet_dir,
        "cdi_dir": args.cdi_dir,
        "log_format": args.log_format,
        "log_level": args.log_level,
        "metrics_address": args.metrics_address,
    }
    return load_settings(config, flags, args.scanner)


def _check_socket_dir(settings: Settings) -> None:
    """Fail early when even the shortest socket name cannot fit a unix socket path."""
    shortest = settings.kubelet_dir / short_socket_file_name("x/y")
    if len(os.fsencode(shortest)) > MAX_UNIX_SOCKET_PATH:
        raise ConfigError(
            "kubelet_dir",
            f"{settings.kubelet_dir} is too long: socket paths in it would exceed the "
            f"{MAX_UNIX_SOCKET_PATH}-byte unix socket limit; use a shorter directory",
        )


def _prepare(args: argparse.Namespace) -> tuple[Settings, list[Scanner]]:
    settings = _settings(args)
    configure(settings.log_format, settings.log_level)
    _warn_unknown_environment()
    scanners = build_scanners(settings.scanners)
    if not scanners:
        raise ConfigError(
            "scanners",
            "no scanner configured: pass --scanner NAME or add a 'scanners:' section to the "
            f"config file (known scanners: {', '.join(sorted(BUILTIN_SCANNERS))})",
        )
    _check_socket_dir(settings)
    return settings, scanners


def _scan(scanners: Sequence[Scanner], output: str) -> int:
    from devplug.cli.report import render
    from devplug.hotplug.scanning import ScanRunner

    try:
        result = ScanRunner(scanners).scan_blocking()
    except ConfigError as exc:
        print(f"devplug: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(render(result.tree, output, result.extras))
    return 0


def _cdi_generate(
    settings: Settings,
    scanners: Sequence[Scanner],
    output_dir: Path | None,
    stdout: bool,
    prune: bool,
) -> int:
    from devplug.cdi.generate import (
        STATIC_CDI_DIR,
        specs_text,
        tree_specs,
        write_tree_specs_blocking,
    )
    from devplug.cdi.sync import default_instance
    from devplug.hotplug.scanning import ScanRunner

    instance = settings.cdi.instance or default_instance(scanners)
    directory = output_dir or STATIC_CDI_DIR
    try:
        tree = ScanRunner(scanners).scan_blocking().tree
        specs = tree_specs(tree, settings.cdi.kinds)
        if stdout:
            sys.stdout.write(specs_text(specs))
            return 0
        written, removed = write_tree_specs_blocking(directory, specs, instance, prune=prune)
    except (ConfigError, CdiSpecError) as exc:
        print(f"devplug: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except FileExistsError as exc:  # ForeignSpecError, SpecHeldError: someone else's file
        print(f"devplug: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"devplug: cannot write specs to {directory}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for name in written:
        print(f"wrote {directory / name}")
    for name in removed:
        print(f"removed {directory / name} (devplug's, for a resource this host no longer has)")
    if not written:
        print(f"no devices found: nothing written to {directory}")
    return 0


def _status(kubelet_dir: Path | None, output: str, timeout: float) -> int:
    import json
    from dataclasses import asdict

    from devplug.cli.status import probe_all
    from devplug.config import DEFAULT_KUBELET_DIR

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    directory = kubelet_dir or Path(os.environ.get("DEVPLUG_KUBELET_DIR") or DEFAULT_KUBELET_DIR)
    try:
        plugins = asyncio.run(probe_all(directory, timeout))
    except OSError as exc:
        print(f"devplug: cannot read {directory}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if output == "json":
        document = {"kubelet_dir": str(directory), "plugins": [asdict(p) for p in plugins]}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0
    if not plugins:
        print(f"no device plugin sockets in {directory}")
        return 0
    rows = [("SOCKET", "RESOURCE", "HEALTHY", "UNHEALTHY", "NUMA", "STATUS")]
    for plugin in plugins:
        state = plugin.error or "serving"
        numa = ",".join(map(str, plugin.numa_nodes)) or "-"
        rows.append(
            (
                plugin.socket,
                plugin.resource or "-",
                str(plugin.healthy) if plugin.error is None else "-",
                str(plugin.unhealthy) if plugin.error is None else "-",
                numa,
                state,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


def _warn_unknown_environment() -> None:
    """A misspelt DEVPLUG_* variable would otherwise be ignored without a word."""
    known = {ENV_PREFIX + key.upper() for key in SCALAR_KEYS} | {
        "DEVPLUG_CONFIG",
        "DEVPLUG_SCANNER",
        "DEVPLUG_TESTS_WITHOUT_UMOCKDEV",
    }
    unknown = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        structlog.get_logger("devplug.config").warning(
            "config.env.unknown", variables=unknown, known=sorted(known)
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"devplug {__version__}")
        return 0
    if args.command == "status":
        return _status(args.kubelet_dir, args.output, args.timeout)
    try:
        settings, scanners = _prepare(args)
    except ConfigError as exc:
        print(f"devplug: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "cdi":
        # The flag is refused: whoever typed it expected the specs there. DEVPLUG_CDI_DIR is
        # not: it is the daemon's setting, present in its environment (a DaemonSet's env) when
        # someone runs this command beside it, and generate never writes to cdi.dir anyway.
        if args.cdi_dir is not None:
            print(
                "devplug: configuration error: cdi generate writes to --output-dir (default "
                "/etc/cdi), not to --cdi-dir, the directory the daemon manages",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        return _cdi_generate(settings, scanners, args.output_dir, args.stdout, args.prune)
    if args.command == "scan" or args.dry_run:
        return _scan(scanners, args.output)

    def reload_config() -> tuple[Settings, Sequence[Scanner]]:
        """SIGHUP: the same file, flags and environment, read again and validated."""
        fresh = _settings(args)
        built = build_scanners(fresh.scanners)
        if not built:
            raise ConfigError("scanners", "no scanner configured")
        return fresh, built

    return run_daemon(settings, scanners, reload_config)


if __name__ == "__main__":
    sys.exit(main())

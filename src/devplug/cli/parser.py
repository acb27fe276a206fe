"""The command line's grammar: every command with only the flags it uses, and its exit codes.

Conventions (those of kubectl, helm, systemctl): ``--version``; ``-o/--output`` picks the
format of every command that prints a document (``table``, ``json``, ``yaml``); each command's
``--help`` has a one-line description and its exit statuses; log levels in any case; flags
before the command as after it (:mod:`devplug.cli.early`); Ctrl-C exits 130.

A plugin author's entry point gets the same parser with its own name, version, description
and scanners.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Collection
from pathlib import Path
from typing import Any

from devplug.cli.early import version_line

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # bad usage or configuration: nothing was served or written
__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser"]

DESCRIPTION = "Kubernetes device plugin daemon: serves devices found through udev."

LOG_LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("table", "json", "yaml")

_EXITS = {
    "run": "0 stopped by SIGTERM or SIGINT; 1 the daemon failed; 2 bad usage or configuration "
    "(nothing was served); 130 interrupted (Ctrl-C) before it served",
    "scan": "0 scanned; 1 a scanner failed or two scanners produced one resource; 2 bad usage "
    "or configuration, or a --replay record that cannot be loaded; 130 interrupted",
    "generate": "0 written or printed; 1 a scanner failed or a spec could not be written (or is "
    "another's); 2 bad usage or configuration; 130 interrupted",
    "status": "0 every plugin answered; 1 a plugin did not answer, or the dir cannot be read, "
    "or (--pods) the pod resources API did not answer; 2 bad usage; 130 interrupted",
    "capture": "0 written; 1 sysfs could not be read or FILE could not be written; 2 bad usage "
    "or configuration; 130 interrupted",
    "deviceclasses": "0 printed; 2 bad usage or configuration (no dra section, or a resource "
    "no selector could find)",
    "cordon": "0 cordoned, or it was already; 1 the daemon refused (an unknown resource or id, "
    "its state file) or no daemon answered; 2 bad usage; 130 interrupted",
    "uncordon": "0 uncordoned, or it was not cordoned; 1 the daemon refused (an unknown resource "
    "or id, its state file) or no daemon answered; 2 bad usage; 130 interrupted",
    "version": "0",
}


def _epilog(command: str) -> str:
    return textwrap.fill(f"exit status: {_EXITS[command]}", width=79)


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def _output(
    parser: argparse.ArgumentParser, choices: tuple[str, ...], default: str, when: str = ""
) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=choices,
        default=default,
        help=f"output format (default {default}){when}",
    )


def _settings_flags(
    parser: argparse.ArgumentParser, scanner_names: Collection[str], *, serving: bool
) -> None:
    """The settings flags; ``serving``: also those only the daemon uses (its dirs, metrics)."""
    group = parser.add_argument_group(
        "settings (each also DEVPLUG_<FLAG> and a config file key; flags win)"
    )
    group.add_argument("--config", type=Path, help="YAML config file (env DEVPLUG_CONFIG)")
    group.add_argument(
        "--scanner",
        action="append",
        default=[],
        metavar="NAME",
        help="add a scanner with its defaults; repeatable (env DEVPLUG_SCANNER, "
        f"comma-separated): {', '.join(sorted(scanner_names))}",
    )
    if serving:
        group.add_argument(
            "--kubelet-dir",
            type=Path,
            help="device plugin dir (default /var/lib/kubelet/device-plugins)",
        )
        group.add_argument("--cdi-dir", type=Path, help="CDI spec dir (default /var/run/cdi)")
        group.add_argument(
            "--metrics-address",
            metavar="HOST:PORT",
            help="serve /metrics, /healthz and /readyz here (default: off)",
        )
    group.add_argument(
        "--log-format",
        type=str.lower,
        choices=["json", "console"],
        help="default: console on a terminal, json otherwise",
    )
    group.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, help="default info (any case)"
    )


def build_parser(
    program: str = "devplug",
    scanner_names: Collection[str] | None = None,
    *,
    version: str | None = None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """``program``'s parser; ``scanner_names`` are the scanners ``--scanner`` may name (by
    default devplug's built-in ones). ``version`` and ``description`` are a plugin's own
    (None: devplug's)."""
    if scanner_names is None:
        from devplug.scanners.registry import BUILTIN_SCANNERS

        scanner_names = BUILTIN_SCANNERS
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=program,
        description=description or DESCRIPTION,
        epilog=textwrap.fill(
            "exit status: 0 success; 1 failure; 2 bad usage or configuration; 130 interrupted; "
            "141 the output's reader went away ('| head'), as after SIGPIPE. "
            f"'{program} COMMAND --help' describes each command; its flags may also come "
            f"before it ('{program} --config FILE scan'). NO_COLOR turns colours off.",
            width=79,
        ),
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=version_line(program, version))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, parent: Any = sub) -> argparse.ArgumentParser:
        made: argparse.ArgumentParser = parent.add_parser(
            name,
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog=_epilog(name),
            formatter_class=formatter,
        )
        return made

    run = command("run", "serve devices to the kubelet until SIGTERM; SIGHUP reloads")
    _settings_flags(run, scanner_names, serving=True)
    run.add_argument(
        "--dry-run", action="store_true", help="print the device tree and exit (as 'scan')"
    )
    _output(run, FORMATS, "table", ", with --dry-run")

    scan = command("scan", "print the device tree that 'run' would serve, and exit")
    _settings_flags(scan, scanner_names, serving=False)
    _output(scan, FORMATS, "table")
    scan.add_argument(
        "--replay",
        type=Path,
        metavar="FILE",
        help="scan the host FILE records ('capture', or umockdev-record) instead of this one; "
        "needs umockdev's preload library (the command restarts itself under it)",
    )

    capture = command(
        "capture",
        "record what the configured scanners read of this host (identifying values scrubbed), "
        "in umockdev's record format, to attach to a bug report",
    )
    _settings_flags(capture, scanner_names, serving=False)
    capture.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="write the record to FILE, atomically (default: stdout)",
    )
    capture.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="NAME",
        help="record this udev property or sysfs attribute unscrubbed (e.g. ID_SERIAL_SHORT "
        "when device ids come from it); repeatable",
    )

    cdi = sub.add_parser("cdi", help="CDI spec files", description="CDI spec files.")
    cdi_sub = cdi.add_subparsers(dest="cdi_command", required=True, metavar="ACTION")
    generate = command(
        "generate", "scan once and write (or print) the CDI specs, without serving", cdi_sub
    )
    _settings_flags(generate, scanner_names, serving=False)
    where = generate.add_mutually_exclusive_group()
    where.add_argument(
        "--output-dir", type=Path, default=None, help="write the specs here (default /etc/cdi)"
    )
    where.add_argument(
        "-o",
        "--output",
        choices=("json", "yaml"),
        default=None,
        help="print the specs as one document (file name -> spec) instead of writing them",
    )
    where.add_argument("--stdout", action="store_true", help="the same as --output json")
    # The daemon's dir: refused with a word (cdi generate never writes there), not offered.
    generate.add_argument("--cdi-dir", type=Path, help=argparse.SUPPRESS)
    generate.add_argument(
        "--prune",
        action="store_true",
        help="also delete specs this config's devplug wrote there before for resources the "
        "host no longer has",
    )

    dra = sub.add_parser(
        "dra", help="Dynamic Resource Allocation", description="Dynamic Resource Allocation."
    )
    dra_sub = dra.add_subparsers(dest="dra_command", required=True, metavar="ACTION")
    deviceclasses = command(
        "deviceclasses",
        "print a DeviceClass for each resource the config serves through DRA, to kubectl apply",
        dra_sub,
    )
    deviceclasses.add_argument(
        "--config", type=Path, help="YAML config file with a 'dra:' section (env DEVPLUG_CONFIG)"
    )
    _output(deviceclasses, ("yaml", "json"), "yaml")

    status = command(
        "status", "ask every device plugin in the kubelet dir what it serves (any vendor's)"
    )
    status.add_argument(
        "--kubelet-dir",
        type=Path,
        help="device plugin dir (default $DEVPLUG_KUBELET_DIR or /var/lib/kubelet/device-plugins)",
    )
    _output(status, FORMATS, "table")
    status.add_argument(
        "--timeout",
        type=positive_seconds,
        default=3.0,
        metavar="SECONDS",
        help="per plugin (default 3)",
    )
    status.add_argument(
        "--pods",
        action="store_true",
        help="also list each device of devplug's resources with the pod and container that "
        "hold it, from the kubelet's pod resources API",
    )
    status.add_argument(
        "--pod-resources-socket",
        type=Path,
        metavar="PATH",
        help="the kubelet's pod resources socket, for --pods (default "
        "pod-resources/kubelet.sock beside the kubelet dir)",
    )
    for name, summary in (
        (
            "cordon",
            "take a device out of service: the running daemon advertises it Unhealthy with the "
            "reason and Allocate refuses it, until uncordoned (kept across restarts)",
        ),
        (
            "uncordon",
            "put a cordoned device back into service (advertised Healthy once it has been "
            "healthy for the health hold-down)",
        ),
    ):
        change = command(name, summary)
        change.add_argument("resource", metavar="RESOURCE", help="e.g. gpu.intel.com/i915")
        change.add_argument("device_id", metavar="ID", help="the device's id, as status lists it")
        if name == "cordon":
            change.add_argument(
                "--reason",
                required=True,
                metavar="TEXT",
                help="why (shown by status, the logs and Allocate's refusal; one line, at most "
                "200 characters)",
            )
        change.add_argument(
            "--kubelet-dir",
            type=Path,
            help="device plugin dir the daemon serves in (default $DEVPLUG_KUBELET_DIR or "
            "/var/lib/kubelet/device-plugins)",
        )
        change.add_argument(
            "--timeout",
            type=positive_seconds,
            default=10.0,
            metavar="SECONDS",
            help="for the daemon's answer (default 10)",
        )
    command("version", "print the version")
    return parser

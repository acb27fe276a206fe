"""Start-up of the command line: ``devplug version``, ``--version``, ``--help`` and ``run --help``
until exit, and ``devplug run`` until it handles SIGHUP, each against ``python -c pass``
measured in the same run (interleaved, so that a busy machine weighs on all alike).

The clock starts before the process is spawned and stops when it has exited (or, for
``run``, when the kernel shows its SIGHUP handler in /proc/PID/status: from then on a SIGHUP
is a reload request, before that it kills).

    .venv/bin/python -m bench.cli_startup [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PYTHON = sys.executable
SCRIPT = Path(PYTHON).with_name("devplug")  # the console script, as installed


def exited(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def sighup_caught(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


def run_guarded(config: Path, kubelet_dir: Path) -> float:
    start = time.perf_counter()
    dirs = ["--kubelet-dir", str(kubelet_dir), "--cdi-dir", str(kubelet_dir.parent / "cdi")]
    process = subprocess.Popen(
        [PYTHON, "-m", "devplug", "run", "--config", str(config), *dirs],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not sighup_caught(process.pid):
            if process.poll() is not None:
                raise RuntimeError(f"devplug run exited with {process.returncode}")
        return time.perf_counter() - start
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVPLUG_")}
    os.environ.clear()
    os.environ.update(env)
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "config.yaml"
        config.write_text(
            "hotplug: {source: none}\nscanners:\n  generic:\n"
            "    - {resource: example.com/null, match: {subsystem: mem, devnode: /dev/null}}\n"
        )
        kubelet_dir = Path(scratch) / "device-plugins"
        kubelet_dir.mkdir()
        cases: dict[str, Callable[[], float]] = {
            "python -c pass": lambda: exited([PYTHON, "-c", "pass"]),
            "devplug version (console script)": lambda: exited([str(SCRIPT), "version"]),
            "python -m devplug version": lambda: exited([PYTHON, "-m", "devplug", "version"]),
            "python -m devplug --version": lambda: exited([PYTHON, "-m", "devplug", "--version"]),
            "python -m devplug --help": lambda: exited([PYTHON, "-m", "devplug", "--help"]),
            "python -m devplug run --help": lambda: exited(
                [PYTHON, "-m", "devplug", "run", "--help"]
            ),
            "devplug run: spawn -> SIGHUP handled": lambda: run_guarded(config, kubelet_dir),
        }
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for case in cases.values():
            case()  # warm the page cache and the bytecode cache
        for _ in range(runs):
            for name, case in cases.items():
                samples[name].append(case())
    floor = statistics.median(samples["python -c pass"])
    for name, values in samples.items():
        ms = sorted(v * 1000 for v in values)
        p50 = statistics.median(ms)
        print(
            f"{name:40} p50 {p50:6.1f} ms  min {ms[0]:6.1f}  max {ms[-1]:6.1f}  "
            f"({p50 / (floor * 1000):.1f}x python -c pass; +{p50 - floor * 1000:.1f} ms)"
        )


if __name__ == "__main__":
    main()

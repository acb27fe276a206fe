"""Shared pieces of the benchmarks: mock hosts, a daemon process, percentiles.

Benchmarks print figures and compare against a floor measured in the same run; they assert
nothing about speed. Run them under umockdev's preload, e.g.
``umockdev-wrapper .venv/bin/python -m bench.allocate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

from devplug.testing import daemon_process as testing_daemon_process
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, preload_active

RENDER_RESOURCE = "example.com/render"
# Far above the card minors, so even 10,000 mock GPUs never clash (real hosts use 128+).
RENDER_MINOR_BASE = 100_000
RENDER_CONFIG = f"""
hotplug: {{source: kernel, resync_s: 3600, poll_s: 3600}}
scanners:
  generic:
    - resource: {RENDER_RESOURCE}
      match: {{subsystem: drm, devnode: /dev/dri/renderD*}}
"""


def require_preload() -> None:
    if not preload_active():
        sys.exit("run benchmarks under umockdev: umockdev-wrapper .venv/bin/python -m bench.<name>")


@contextlib.contextmanager
def scratch_dir(size: str = "1g") -> Iterator[Path]:
    """A short scratch dir, on a tmpfs when we may mount one (symlink-heavy testbeds are slow
    to build on this machine's disk: ~2,000 symlinks/s against ~150,000/s on tmpfs)."""
    path = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def gpu_address(index: int) -> str:
    """A distinct PCI address per index (8 functions x 32 slots per bus: 65,280 fit)."""
    bus, rest = divmod(index, 256)
    slot, function = divmod(rest, 8)
    return f"0000:{bus + 1:02x}:{slot:02x}.{function}"


def add_gpu(host: UmockdevHost, index: int) -> str:
    """Mock GPU number ``index`` (card minor ``index``, render minor above the cards)."""
    return add_intel_gpu(
        host,
        gpu_address(index),
        card=index,
        render=RENDER_MINOR_BASE + index,
        numa_node=index % 2,
    )


def gpu_host(root: Path, count: int) -> UmockdevHost:
    """``count`` Intel GPUs, each a PCI function with card and render nodes."""
    host = UmockdevHost(root)
    for index in range(count):
        add_gpu(host, index)
    return host


def render_ids(count: int) -> list[str]:
    return [f"dri_renderD{RENDER_MINOR_BASE + i}" for i in range(count)]


@contextlib.asynccontextmanager
async def daemon_process(
    config_text: str,
    kubelet_dir: Path,
    host: UmockdevHost,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``devplug run`` in its own process, seeing ``host``, its output discarded; ``env`` is
    added to its environment (grpc settings, say). ``python``: the interpreter to run it with
    (default this one), e.g. :func:`runtime_python`'s."""
    config = kubelet_dir.parent / "config.yaml"
    config.write_text(config_text)
    async with testing_daemon_process(
        config,
        kubelet_dir,
        env={**host.env(), **(env or {})},
        output=asyncio.subprocess.DEVNULL,
        python=python,
    ) as process:
        yield process


REPO = Path(__file__).resolve().parent.parent
RUNTIME_VENV = REPO / ".bench" / "runtime-venv"


def compile_bytecode(python: str, *trees: Path | str) -> None:
    """Byte-compile ``trees`` for ``python``, as pip does when it installs a wheel.

    This machine sets PYTHONDONTWRITEBYTECODE, so without this every start compiles devplug's
    own modules from source (~90 ms of a 1-device start), which no operator's install does.
    checked-hash: each import checks the source's hash, so a file edited since (by anyone
    working in the tree) is never run from a stale .pyc."""
    subprocess.run(
        [python, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash"]
        + [str(tree) for tree in trees],
        check=True,
    )


def runtime_python() -> str:
    """An interpreter with devplug installed as an operator installs it: the checkout
    (editable, so it runs the current source) and its runtime dependencies only, no test
    extras (so no rich, which import-linter pulls in and structlog imports when present).

    Created once in ``.bench/runtime-venv`` (gitignored) from PyPI; installed again when
    pyproject.toml changes."""
    python = RUNTIME_VENV / "bin" / "python"
    stamp = RUNTIME_VENV / "pyproject.sha256"
    wanted = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return str(python)
    print(f"installing devplug's runtime dependencies into {RUNTIME_VENV} ...", file=sys.stderr)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(RUNTIME_VENV)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-warn-conflicts", "-e", str(REPO)],
        check=True,
    )
    stamp.write_text(wanted)
    return str(python)


def env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` arguments (``--env``) as a dict."""
    return dict(pair.split("=", 1) for pair in pairs)


def percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def summary_ms(samples: Sequence[float]) -> str:
    ms = [s * 1000 for s in samples]
    return (
        f"n={len(ms)} p50={percentile(ms, 0.50):.3f} ms p99={percentile(ms, 0.99):.3f} ms "
        f"mean={statistics.fmean(ms):.3f} ms max={max(ms):.3f} ms"
    )

"""``devplug cdi generate``: specs from one scan, written or printed, without a daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from devplug.cdi.ownership import STATE_DIR, read_record
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu


def devplug(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devplug", "cdi", "generate", "--scanner", "intel-gpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def gpus(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    add_intel_gpu(host, "0000:03:00.0", card=1, render=129, driver="xe")


def test_stdout_prints_every_spec_by_file_name(host: UmockdevHost) -> None:
    gpus(host)
    result = devplug("--stdout")
    assert result.returncode == 0, result.stderr
    specs = json.loads(result.stdout)
    assert sorted(specs) == ["gpu.intel.com-i915.json", "gpu.intel.com-xe.json"]
    xe = specs["gpu.intel.com-xe.json"]
    # PCI addresses start with a digit: 0.5.0, and nothing of devplug's own raises it.
    assert xe["kind"] == "gpu.intel.com/xe" and xe["cdiVersion"] == "0.5.0"
    assert "annotations" not in xe
    assert [d["name"] for d in xe["devices"]] == ["0000:03:00.0"]


def test_output_dir_is_written_and_pruned_only_when_asked(
    host: UmockdevHost, short_dir: Path
) -> None:
    gpus(host)
    out = short_dir / "cdi"
    out.mkdir()

    def marked(instance: str) -> str:
        """A spec as devplug wrote it before it kept records (0.6.0, annotated, compact)."""
        annotations = {"devplug.io/managed-by": "devplug", "devplug.io/instance": instance}
        head = {"cdiVersion": "0.6.0", "kind": "gpu.intel.com/gone", "annotations": annotations}
        return json.dumps(head, separators=(",", ":"))[:-1] + ',"devices":[]}'

    ours_stale, other_instance = marked("intel_gpu"), marked("generic")
    (out / "gpu.intel.com-gone.json").write_text(ours_stale)
    (out / "example.com-theirs.json").write_text(other_instance)
    (out / "vendor-foreign.json").write_text('{"kind":"vendor.example/x","devices":[]}')

    kept = devplug("--output-dir", str(out))
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.splitlines() == [
        f"wrote {out}/gpu.intel.com-i915.json",
        f"wrote {out}/gpu.intel.com-xe.json",
    ]
    assert (out / "gpu.intel.com-gone.json").exists()  # no --prune: nothing removed
    # The ownership records: where runtimes do not look, naming no running daemon.
    record = asyncio.run(read_record(out, "gpu.intel.com-xe.json"))
    assert record is not None and record.instance == "intel_gpu" and record.owner == ""

    pruned = devplug("--output-dir", str(out), "--prune")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines()[-1].startswith(f"removed {out}/gpu.intel.com-gone.json")
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [
        "example.com-theirs.json",  # another instance's: left alone
        "gpu.intel.com-i915.json",
        "gpu.intel.com-xe.json",
        "vendor-foreign.json",  # not devplug's: left alone
    ]
    assert (out / "gpu.intel.com-xe.json").stat().st_mode & 0o777 == 0o644


def test_the_daemons_cdi_dir_is_refused(host: UmockdevHost, short_dir: Path) -> None:
    gpus(host)
    result = devplug("--cdi-dir", str(short_dir / "cdi"))
    assert result.returncode == 2
    assert "--output-dir" in result.stderr and not (short_dir / "cdi").exists()


def test_the_daemons_cdi_dir_in_the_environment_is_ignored(
    host: UmockdevHost, short_dir: Path
) -> None:
    """Run beside a daemon whose environment sets DEVPLUG_CDI_DIR: the specs still go to
    --output-dir, and the daemon's directory is not touched."""
    gpus(host)
    out, daemons = short_dir / "out", short_dir / "cdi"
    result = devplug("--output-dir", str(out), env={"DEVPLUG_CDI_DIR": str(daemons)})
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [
        "gpu.intel.com-i915.json",
        "gpu.intel.com-xe.json",
    ]
    assert not daemons.exists()


def test_a_name_someone_else_holds_fails_the_run_before_any_spec_is_written(
    host: UmockdevHost, short_dir: Path
) -> None:
    gpus(host)
    out = short_dir / "cdi"
    out.mkdir()
    foreign = '{"kind":"gpu.intel.com/xe","devices":[]}'
    (out / "gpu.intel.com-xe.json").write_text(foreign)  # the second spec's name, not ours
    result = devplug("--output-dir", str(out))
    assert result.returncode == 1
    assert "gpu.intel.com-xe.json exists and was not written by devplug" in result.stderr
    # The first spec (i915, sorted before xe) is not written either: all or none.
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == ["gpu.intel.com-xe.json"]
    assert (out / "gpu.intel.com-xe.json").read_text() == foreign

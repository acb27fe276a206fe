"""``devplug cdi generate``: specs from one scan, written or printed, without a daemon."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from devplug.cdi.generate import config_identity
from devplug.cdi.ownership import STATE_DIR, read_record
from devplug.cdi.store import SpecStore
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu


def generate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devplug", "cdi", "generate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def devplug(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return generate("--scanner", "intel_gpu", *args, env=env)


def specs_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.json"))


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
        """A spec whose annotations say a devplug of ``instance`` wrote it: without a record,
        someone else's file all the same."""
        annotations = {"devplug.io/managed-by": "devplug", "devplug.io/instance": instance}
        head = {"cdiVersion": "0.6.0", "kind": "gpu.intel.com/claimed", "annotations": annotations}
        return json.dumps(head, separators=(",", ":"))[:-1] + ',"devices":[]}'

    # An earlier run of this command with the same scanner and no config file, for a resource
    # the host no longer has.
    gone = b'{"cdiVersion":"0.3.0","kind":"gpu.intel.com/gone","devices":[]}'
    earlier = SpecStore(out, "intel_gpu", config=config_identity(None))
    asyncio.run(earlier.write_all([("gpu.intel.com-gone.json", "gpu.intel.com/gone", gone)]))
    (out / "gpu.intel.com-claimed.json").write_text(marked("intel_gpu"))
    (out / "example.com-theirs.json").write_text(marked("generic"))
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
    assert record.config == ""  # no config file given

    pruned = devplug("--output-dir", str(out), "--prune")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines()[-1].startswith(f"removed {out}/gpu.intel.com-gone.json")
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [
        "example.com-theirs.json",  # claims another instance: left alone
        "gpu.intel.com-claimed.json",  # claims this one, without a record: left alone
        "gpu.intel.com-i915.json",
        "gpu.intel.com-xe.json",
        "vendor-foreign.json",  # not devplug's: left alone
    ]
    assert (out / "gpu.intel.com-xe.json").stat().st_mode & 0o777 == 0o644


GENERIC = """
scanners:
  generic:
    - {resource: example.com/%s, match: {subsystem: drm, devnode: "/dev/dri/%s*"}}
"""


def test_prune_removes_only_what_the_given_config_no_longer_makes(
    host: UmockdevHost, short_dir: Path
) -> None:
    """Two configs of the same scanner (one instance, by default) generating into one dir:
    neither one's --prune takes the other's specs; a config's own spec goes once that config
    no longer makes it."""
    gpus(host)
    out = short_dir / "cdi"
    cards, renders = short_dir / "cards.yaml", short_dir / "renders.yaml"
    cards.write_text(GENERIC % ("card", "card"))
    renders.write_text(GENERIC % ("render", "renderD"))
    for config in (cards, renders):
        result = generate("--config", str(config), "--output-dir", str(out), "--prune")
        assert result.returncode == 0, result.stderr
    assert specs_in(out) == ["example.com-card.json", "example.com-render.json"]
    cards.write_text(GENERIC % ("display", "card"))  # the entry renamed
    result = generate("--config", str(cards), "--output-dir", str(out), "--prune")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"wrote {out}/example.com-display.json",
        f"removed {out}/example.com-card.json (devplug's, for a resource this host no longer has)",
    ]
    assert specs_in(out) == ["example.com-display.json", "example.com-render.json"]
    # The config named through the environment is the same config.
    result = generate("--output-dir", str(out), "--prune", env={"DEVPLUG_CONFIG": str(renders)})
    assert result.returncode == 0, result.stderr
    assert specs_in(out) == ["example.com-display.json", "example.com-render.json"]


def test_devplugs_own_specs_copied_elsewhere_are_recognised(
    host: UmockdevHost, short_dir: Path
) -> None:
    gpus(host)
    first, second = short_dir / "first", short_dir / "second"
    assert devplug("--output-dir", str(first)).returncode == 0
    second.mkdir()
    for spec in first.glob("*.json"):
        shutil.copy2(spec, second / spec.name)  # the specs, not devplug's records beside them
    before = {p.name: p.stat().st_mtime_ns for p in second.glob("*.json")}
    result = devplug("--output-dir", str(second))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"wrote {second}/gpu.intel.com-i915.json",
        f"wrote {second}/gpu.intel.com-xe.json",
    ]
    assert {p.name: p.stat().st_mtime_ns for p in second.glob("*.json")} == before  # kept
    record = asyncio.run(read_record(second, "gpu.intel.com-xe.json"))
    assert record is not None and record.instance == "intel_gpu"


def test_the_daemons_cdi_dir_is_refused(host: UmockdevHost, short_dir: Path) -> None:
    gpus(host)
    result = devplug("--cdi-dir", str(short_dir / "cdi"))
    assert result.returncode == 2
    assert "--output-dir" in result.stderr and not (short_dir / "cdi").exists()


def test_the_daemons_cdi_dir_in_the_environment_is_refused(
    host: UmockdevHost, short_dir: Path
) -> None:
    """Ignored, the variable would send the specs to /etc/cdi while its setter expects them
    in its directory: refused in one line, like --cdi-dir, and nothing is written."""
    gpus(host)
    out, daemons = short_dir / "out", short_dir / "cdi"
    result = devplug("--output-dir", str(out), env={"DEVPLUG_CDI_DIR": str(daemons)})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "devplug: configuration error: DEVPLUG_CDI_DIR is set, but cdi generate writes to "
        "--output-dir (default /etc/cdi), never to the daemon's directory: unset it for this "
        "command"
    ]
    assert not out.exists() and not daemons.exists()
    # Empty counts as unset, as for every DEVPLUG_ variable.
    assert devplug("--output-dir", str(out), env={"DEVPLUG_CDI_DIR": ""}).returncode == 0


def test_names_someone_else_holds_fail_the_run_before_any_spec_is_written(
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
    # The first spec (i915, sorted before xe) is not written either: all or none. Nothing is
    # left behind, the state dir included.
    assert sorted(os.listdir(out)) == ["gpu.intel.com-xe.json"]
    assert (out / "gpu.intel.com-xe.json").read_text() == foreign

    (out / "gpu.intel.com-i915.json").write_text(foreign.replace("xe", "i915"))
    result = devplug("--output-dir", str(out))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "devplug: 2 spec files are taken by files devplug may not replace; nothing was written:",
        f"  {out}/gpu.intel.com-i915.json exists and was not written by devplug; it is left "
        "alone: remove it, or give the resource another kind in cdi.kinds",
        f"  {out}/gpu.intel.com-xe.json exists and was not written by devplug; it is left "
        "alone: remove it, or give the resource another kind in cdi.kinds",
    ]
    assert sorted(os.listdir(out)) == ["gpu.intel.com-i915.json", "gpu.intel.com-xe.json"]

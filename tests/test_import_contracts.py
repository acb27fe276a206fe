"""The import contracts bite: a forbidden import planted anywhere in a copy of the package makes
``lint-imports`` report the contract it breaks, and the unmodified copy passes.

Each plant goes into its own copy of ``src/devplug`` (with ``pyproject.toml`` beside it); the
copy is analysed by putting its ``src`` first on ``PYTHONPATH`` (ahead of the editable install's
path entry) and running ``lint-imports`` there with ``--contract`` naming the contract that must
break, so a plant is only counted when that contract reports it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "devplug"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS: list[dict[str, Any]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "importlinter"
]["contracts"]


@dataclass(frozen=True)
class Plant:
    """``code`` appended to ``path`` (below ``src/devplug``; created when missing) must break
    the contract ``contract``, and the report must name ``module``, the planted module."""

    contract: str
    path: str
    code: str

    @property
    def module(self) -> str:
        parts = ["devplug", *Path(self.path).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(dotted: str) -> str:
    """The file of a module of the real tree, relative to ``src/devplug``."""
    relative = Path(*dotted.split(".")[1:])
    if (PACKAGE / relative).is_dir():
        return str(relative / "__init__.py")
    return str(relative.with_suffix(".py"))


def first_module(room: str) -> str:
    """A module of a room (``cdi``, ...) other than its ``__init__``, so plants survive renames."""
    modules = sorted(p.name for p in (PACKAGE / room).glob("*.py") if p.name != "__init__.py")
    assert modules, f"no modules in src/devplug/{room}"
    return f"{room}/{modules[0]}"


def layer_names(layer: str) -> list[str]:
    separator = "|" if "|" in layer else ":"
    return [name.strip().strip("()") for name in layer.split(separator)]


def upward_plants() -> list[Plant]:
    """For each room layered inside: its lowest layer imports its highest one."""
    plants = []
    for contract in CONTRACTS:
        if contract["type"] != "layers" or contract["containers"] == ["devplug"]:
            continue
        (container,) = contract["containers"]
        top = layer_names(contract["layers"][0])[0]
        bottom = layer_names(contract["layers"][-1])[0]
        path = module_file(f"{container}.{bottom}")
        plants.append(Plant(contract["id"], path, f"import {container}.{top}"))
    return plants


PLANTS = [
    Plant("pyudev", "scanners/intel_gpu/entry.py", "import pyudev"),
    # A module added later is checked as well as the ones there today.
    Plant("pyudev", "scanners/intel_gpu/planted.py", "from pyudev import Context"),
    # Imports inside functions count: lazy loading is no way round a contract.
    Plant("pyudev", "hotplug/listener.py", "def _planted() -> None:\n    import pyudev.monitor"),
    Plant("grpc", "daemon.py", "import grpc"),
    Plant("grpc", "config/files.py", "from google.protobuf import message"),
    Plant("grpc", "scanners/base.py", "from devplug._proto import deviceplugin_v1beta1_pb2"),
    Plant("grpc", "dra/slices.py", "import grpc.aio"),
    Plant("lightkube", "dra/slices.py", "import lightkube"),
    Plant("lightkube", "cli/status.py", "import httpx2"),
    Plant("fronts", first_module("cdi"), "import devplug.kubelet"),
    Plant("fronts", "kubelet/servicer.py", "import devplug.cdi"),
    Plant("fronts", "hotplug/loop.py", "import devplug.dra"),
    Plant("fronts", "dra/slices.py", "from devplug.ops import metrics"),
    Plant("layers", "scanners/base.py", "from devplug import daemon"),
    Plant("layers", "model.py", "import devplug.scanners"),
    Plant("layers", "ops/limits.py", "import devplug.plugin"),
    # A new top-level module must be given a layer.
    Plant("layers", "planted.py", "import devplug.errors"),
    Plant("facade", "ops/limits.py", "from devplug import DeviceInfo"),
    # cli is above testing, but a command on a node must not load the test tools.
    Plant("testing", "cli/capture.py", "from devplug.testing.umockdev import UmockdevHost"),
    Plant("kits", "_kits/backoff.py", "import devplug.errors"),
    Plant("kubelet-layers", "kubelet/planted.py", "import devplug.kubelet.wire"),
    *upward_plants(),
]


def copy_tree(destination: Path) -> Path:
    """A copy of the package and the contracts; returns the directory to run lint-imports in."""
    shutil.copytree(
        PACKAGE, destination / "src" / "devplug", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy2(ROOT / "pyproject.toml", destination / "pyproject.toml")
    return destination


def plant(tree: Path, path: str, code: str) -> None:
    target = tree / "src" / "devplug" / path
    assert target.parent.is_dir(), f"{path}: no such room in src/devplug"
    existing = target.read_text() if target.exists() else ""
    target.write_text(f"{existing}\n{code}\n")


def lint_imports(tree: Path, contracts: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    environment: Mapping[str, str] = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [str(LINT_IMPORTS), "--no-cache", "--no-logo", "pyproject.toml"]
    for contract in contracts:
        command += ["--contract", contract]
    return subprocess.run(
        command,
        cwd=tree,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_broken(result: subprocess.CompletedProcess[str], finding: str) -> None:
    """Exactly the contract asked for broke, and its report says ``finding`` (the plant)."""
    report = result.stdout + result.stderr
    assert result.returncode == 1, report
    assert "Contracts: 0 kept, 1 broken." in report, report
    assert finding in report, f"the report does not say {finding!r}:\n{report}"


def test_the_unmodified_copy_passes(tmp_path: Path) -> None:
    result = lint_imports(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout, result.stdout


@pytest.mark.parametrize(
    "planted", PLANTS, ids=[f"{p.contract}:{p.path}:{p.code.splitlines()[-1]}" for p in PLANTS]
)
def test_a_planted_import_breaks_its_contract(tmp_path: Path, planted: Plant) -> None:
    tree = copy_tree(tmp_path)
    plant(tree, planted.path, planted.code)
    assert_broken(lint_imports(tree, [planted.contract]), planted.module)


def test_a_cycle_inside_a_room_breaks_the_acyclic_contract(tmp_path: Path) -> None:
    """Reverse one import between two modules of a room the layers contracts do not cover."""
    layered = {c["containers"][0] for c in CONTRACTS if c["type"] == "layers"}
    graph = grimp.build_graph("devplug")
    edges = sorted(
        (room, importer, imported)
        for room in graph.modules
        if room not in layered
        for importer in graph.find_children(room)
        for imported in graph.find_modules_directly_imported_by(importer)
        if imported in graph.find_children(room)
    )
    assert edges, "no room has two modules where one imports the other"
    room, importer, imported = edges[0]
    tree = copy_tree(tmp_path)
    plant(tree, module_file(imported), f"import {importer}")
    assert_broken(lint_imports(tree, ["acyclic"]), f"No cycles are allowed in {room}.")


def test_every_contract_has_a_plant() -> None:
    """A contract nobody tries to break could be one that never breaks."""
    planted = {p.contract for p in PLANTS} | {"acyclic"}
    assert {c["id"] for c in CONTRACTS} <= planted

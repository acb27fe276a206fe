"""Every config file shipped in examples/ and deploy/ loads and builds its scanners."""

from __future__ import annotations

from pathlib import Path

import pytest

from devplug.config import load_settings
from devplug.scanners.registry import build_scanners

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted([*ROOT.glob("examples/*.yaml"), *ROOT.glob("deploy/kubernetes/*/config.yaml")])


def test_there_are_shipped_configs() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in SHIPPED}
    assert {"examples/intel-gpu.yaml", "deploy/kubernetes/intel-gpu/config.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_shipped_config_is_valid(path: Path) -> None:
    settings = load_settings(path, {}, [], environ={})
    assert build_scanners(settings.scanners), f"{path} configures no scanner"

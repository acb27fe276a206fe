"""The README's code and commands stay true: its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


async def test_the_plugin_author_example_runs(short_dir: Path) -> None:
    from devplug.testing.umockdev import preload_active

    if not preload_active():
        pytest.skip("the example runs against umockdev hardware: needs its preload")
    scanner_code, test_code = python_blocks()
    namespace: dict[str, Any] = {}
    exec(compile(scanner_code, "README.md:scanner", "exec"), namespace)
    exec(compile(test_code, "README.md:test", "exec"), namespace)
    await namespace["test_camera"](short_dir)


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "umockdev-wrapper .venv/bin/python -m pytest"
    assert f"`{ci[-1]}`" in README
    assert f"&& {ci[-1]}\n" in README

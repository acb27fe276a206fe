"""Reading a YAML config file: one-line errors naming the file (and the line and column of a
YAML error), and a key given twice in one mapping refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from devplug._kits.interruptible import read_bytes
from devplug.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last,
    which silently drops the first section)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor says so itself
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: ``LINE:COLUMN: problem`` (PyYAML's own text spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        where = f"{mark.line + 1}:{mark.column + 1}: " if mark is not None else " "
        return " ".join(f"{where}not valid YAML: {problem}".split())
    return " " + " ".join(f"not valid YAML: {exc}".split())


def read_config_file(path: Path, source: str = "--config") -> dict[str, Any]:
    """Load a YAML config file; an empty file is an empty config.

    Errors are one line naming the file, under ``source`` (the flag or variable that named it).
    """
    try:
        raw = read_bytes(path)  # a FIFO nobody writes: a stop signal still ends the wait
    except FileNotFoundError:
        raise ConfigError(source, f"file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(source, f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            source,
            f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"{path}:{_yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(source, f"{path} must hold a mapping at the top level")
    return data

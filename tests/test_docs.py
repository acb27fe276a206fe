"""The user documentation in docs/ stays true to the code.

- Every field of the settings models is documented in docs/configuration.md, as its dotted path
  in a table row, and every setting named there exists.
- The code blocks of docs/writing-a-scanner.md, put in the files they name, import, and each
  test function they define passes (with the fixtures it names; ``tmp_path`` is a short
  directory, as unix socket paths need). tests/test_guide_venv.py runs the same files the way
  an outsider does: devplug installed into a fresh virtualenv, pytest, the plugin's commands.
- Every metric of the daemon's registry is described in docs/operations.md.
- Every ``devplug ...`` command line in the docs' shell blocks parses with devplug's own parser.
- Every log event the docs (README.md, docs/*.md) name is logged somewhere in src.
- Every benchmark in bench/ has its command in docs/benchmarks.md, and every command there runs
  a module of bench/.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import BaseModel

from devplug.cli import build_parser
from devplug.config import CdiSettings, HotplugSettings, Settings
from devplug.ops.metrics import Metrics
from devplug.scanners.generic import GenericEntry, GenericMatch
from devplug.scanners.intel_gpu.settings import IntelGpuSettings
from devplug.scanners.registry import BUILTIN_SCANNERS
from devplug.scanners.vfio.settings import VfioDeviceEntry, VfioSettings
from devplug.testing.umockdev import preload_active

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
GUIDE = DOCS / "writing-a-scanner.md"
OPERATIONS = DOCS / "operations.md"

# Built-in scanner -> (the model of its config section, whether the section is a list of them).
SCANNER_SECTIONS: dict[str, tuple[type[BaseModel], bool]] = {
    "generic": (GenericEntry, True),
    "intel_gpu": (IntelGpuSettings, False),
    "vfio": (VfioSettings, False),
}
SETTINGS_MODELS = {
    Settings,
    HotplugSettings,
    CdiSettings,
    GenericEntry,
    GenericMatch,
    IntelGpuSettings,
    VfioSettings,
    VfioDeviceEntry,
}
SUBCOMMANDS = {"run", "scan", "capture", "cdi", "dra", "status", "cordon", "uncordon", "version"}


# ------------------------------------------------------------------------ configuration


def nested_model(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """The settings model a field holds, and whether it holds a list (or tuple) of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple) and args:
        inner = nested_model(args[0])
        return None if inner is None else (inner[0], True)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = nested_model(arg)
            if found is not None:
                return found
    return None


def model_paths(model: type[BaseModel], prefix: str, seen: set[type[BaseModel]]) -> Iterator[str]:
    """Dotted paths of ``model``'s fields and of the models below them (lists as ``[]``)."""
    seen.add(model)
    for name, field in model.model_fields.items():
        path = prefix + name
        yield path
        nested = nested_model(field.annotation)
        if nested is not None:
            inner, many = nested
            yield from model_paths(inner, path + ("[]." if many else "."), seen)


def setting_paths(seen: set[type[BaseModel]] | None = None) -> list[str]:
    """Every setting: the top-level models' fields, then each built-in scanner's section."""
    seen = set() if seen is None else seen
    paths = list(model_paths(Settings, "", seen))
    for name, (model, many) in SCANNER_SECTIONS.items():
        section = f"scanners.{name}"
        paths.append(section)
        paths.extend(model_paths(model, section + ("[]." if many else "."), seen))
    return paths


def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.lstrip().startswith("|")
    ]


def test_every_settings_model_and_builtin_scanner_is_walked() -> None:
    assert set(SCANNER_SECTIONS) == set(BUILTIN_SCANNERS), "add the new scanner's settings model"
    seen: set[type[BaseModel]] = set()
    setting_paths(seen)
    assert seen >= SETTINGS_MODELS, SETTINGS_MODELS - seen


def test_every_setting_is_in_a_table_row_of_the_configuration_reference() -> None:
    documented = {
        key
        for row in table_rows(CONFIGURATION.read_text())
        for key in re.findall(r"`([^`]+)`", "|".join(row))
    }
    missing = [path for path in setting_paths() if path not in documented]
    assert not missing, f"settings without a row in {CONFIGURATION.name}: {missing}"


def test_every_setting_the_reference_lists_exists() -> None:
    known = set(setting_paths())
    setting = re.compile(r"[a-z][a-z0-9_]*(?:\[\])?(?:\.[a-z][a-z0-9_]*(?:\[\])?)*")
    listed = {
        token
        for row in table_rows(CONFIGURATION.read_text())
        for token in re.findall(r"`([^`]+)`", row[0])
        if setting.fullmatch(token)
    }
    assert listed, "no settings found in the reference's tables"
    assert listed <= known, f"documented but not settings: {sorted(listed - known)}"


# ------------------------------------------------------------------------ scanner guide


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def guide_files(text: str | None = None) -> dict[str, str]:
    """The guide's files: each code block starts with ``# NAME`` (``# NAME (continued)``), and
    the blocks of one file are joined in order."""
    text = GUIDE.read_text() if text is None else text
    files: dict[str, str] = {}
    for language, body in re.findall(
        r"^```(python|ini|yaml|toml)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE
    ):
        header = re.match(r"# ([\w.-]+\.(?:py|ini|yaml|toml))( \(continued\))?\n", body)
        assert header is not None, f"a {language} block of the guide names no file: {body[:60]!r}"
        name, continued = header.groups()
        assert (name in files) == bool(continued), f"{name}: '(continued)' only after its start"
        files[name] = files.get(name, "") + ("\n\n" if continued else "") + body
    return files


def guide_tests() -> list[tuple[str, str]]:
    return [
        (name.removesuffix(".py"), test)
        for name, body in guide_files().items()
        if name.startswith("test_") and name.endswith(".py")
        for test in re.findall(r"^(?:async )?def (test_\w+)\(", body, flags=re.MULTILINE)
    ]


def test_the_guide_has_a_scanner_its_entry_point_and_its_tests() -> None:
    files = guide_files()
    assert {"misc_plugin.py", "test_misc_plugin.py", "pytest.ini", "config.yaml"} <= set(files)
    assert re.search(r"def scan\(self, source: UdevSource\)", files["misc_plugin.py"])
    assert "asyncio_mode = auto" in files["pytest.ini"]
    assert len(guide_tests()) >= 3


def test_every_guide_block_is_in_a_file() -> None:
    """A block outside the files would not run in the outsider's test below."""
    text = GUIDE.read_text()
    for language, body in re.findall(
        r"^```(python|ini|yaml|toml)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE
    ):
        assert body.startswith("# "), f"a {language} block names no file"


# The modules a plugin author may name: devplug's public ones, each with its __all__.
PUBLIC_MODULES = ("devplug", "devplug.testing", "devplug.testing.umockdev")


def test_the_guide_names_only_public_names() -> None:
    """What the guide imports from devplug, and every ``devplug.<name>`` it mentions, is
    public: a public module, or a name in one's ``__all__``."""
    public = {name: set(importlib.import_module(name).__all__) for name in PUBLIC_MODULES}

    def problem(module: str, name: str | None) -> str | None:
        if module not in public:
            return f"{module} is not a public module"
        if name is not None and name not in public[module]:
            return f"{name} is not in {module}.__all__"
        return None

    problems = []
    for file_name, body in guide_files().items():
        if not file_name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("devplug"):
                problems += [problem(node.module or "", alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                problems += [
                    problem(a.name, None) for a in node.names if a.name.startswith("devplug")
                ]
    for dotted in re.findall(r"(?<![\w./-])(devplug(?:\.\w+)+)", GUIDE.read_text()):
        parts = dotted.split(".")
        module = max(
            (".".join(parts[:n]) for n in range(1, len(parts) + 1)),
            key=lambda prefix: (prefix in public, len(prefix)),
        )
        rest = dotted.removeprefix(module).lstrip(".")
        problems.append(problem(module, rest.split(".")[0] if rest else None))
    assert [p for p in problems if p is not None] == []


@pytest.fixture
def guide_dir(short_dir: Path) -> Iterator[Path]:
    """The guide's files in a directory that is importable for the duration of a test."""
    directory = short_dir / "plugin"
    directory.mkdir()
    for name, body in guide_files().items():
        (directory / name).write_text(body)
    before = set(sys.modules)
    sys.path.insert(0, str(directory))
    try:
        yield directory
    finally:
        sys.path.remove(str(directory))
        for name in set(sys.modules) - before:
            module = sys.modules[name]
            if str(directory) in str(getattr(module, "__file__", "") or ""):
                del sys.modules[name]


@pytest.mark.parametrize(("module", "name"), guide_tests())
async def test_the_scanner_guide_runs(
    module: str, name: str, guide_dir: Path, short_dir: Path, request: pytest.FixtureRequest
) -> None:
    function = getattr(importlib.import_module(module), name)
    if "UmockdevHost" in function.__code__.co_names and not preload_active():
        pytest.skip("needs umockdev's preload: run under umockdev-wrapper")
    arguments = {
        parameter: short_dir if parameter == "tmp_path" else request.getfixturevalue(parameter)
        for parameter in inspect.signature(function).parameters
    }
    result = function(**arguments)
    if inspect.isawaitable(result):
        await result


# ------------------------------------------------------------------------ metrics


def exposed_metric_names() -> list[str]:
    """The names /metrics shows for each family of the daemon's registry (counters: _total)."""
    return [
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in Metrics().registry.collect()
    ]


def test_every_metric_is_described_in_the_operations_guide() -> None:
    names = exposed_metric_names()
    assert names
    described = {
        key
        for row in table_rows(OPERATIONS.read_text())
        for key in re.findall(r"`([^`]+)`", row[0])
    }
    missing = [name for name in names if name not in described]
    assert not missing, f"metrics without a row in {OPERATIONS.name}: {missing}"


# ------------------------------------------------------------------------ command lines

# Words after which ``devplug`` is a command being run, not an argument (a unit or image name).
COMMAND_POSITION = {None, "&&", "||", "|", ";", "(", "--", "sudo", "env", "time", "nice"}
STOP_TOKENS = set("();<>|&")


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block, indented ones included."""
    blocks: list[tuple[str, list[str]]] = []
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if language is None:
                language, lines = stripped[3:].strip(), []
            else:
                blocks.append((language, lines))
                language = None
        elif language is not None:
            lines.append(stripped)
    return blocks


def command_lines(text: str) -> list[str]:
    """Shell commands: every line of ``sh`` blocks, and ``$ `` lines of plain blocks."""
    found: list[str] = []
    for language, lines in fenced_blocks(text):
        if language == "sh":
            joined = "\n".join(lines).replace("\\\n", " ")
            found += [line for line in joined.splitlines() if line and not line.startswith("#")]
        elif language == "":
            found += [line[2:] for line in lines if line.startswith("$ ")]
    return found


def devplug_invocations(line: str) -> list[list[str]]:
    """The arguments of each ``devplug`` (or ``.../bin/devplug``) run on a command line."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    runs: list[list[str]] = []
    for index, token in enumerate(tokens):
        before = tokens[index - 1] if index else None
        if token.rsplit("/", 1)[-1] != "devplug":
            continue
        if before not in COMMAND_POSITION and not re.fullmatch(
            r"[A-Z_][A-Z0-9_]*=.*", before or ""
        ):
            continue
        arguments: list[str] = []
        for argument in tokens[index + 1 :]:
            if set(argument) <= STOP_TOKENS:
                break
            arguments.append(argument)
        runs.append(arguments)
    return runs


def test_the_command_line_finder_tells_commands_from_names() -> None:
    assert devplug_invocations("sudo .venv/bin/devplug scan -o json && devplug version") == [
        ["scan", "-o", "json"],
        ["version"],
    ]
    assert devplug_invocations("kubectl exec daemonset/devplug -- devplug status") == [["status"]]
    assert devplug_invocations("systemctl reload devplug") == []
    assert devplug_invocations("docker build -t devplug:latest .") == []


def test_every_devplug_command_line_in_the_docs_parses() -> None:
    parser = build_parser()
    seen: set[str] = set()
    for path in sorted(DOCS.glob("*.md")):
        for line in command_lines(path.read_text()):
            for arguments in devplug_invocations(line):
                try:
                    parsed = parser.parse_args(arguments)
                except SystemExit:
                    parsed = None  # argparse has printed why on stderr
                assert parsed is not None, f"{path.name}: not a valid devplug command: {line}"
                assert parsed.command in SUBCOMMANDS, line
                seen.add(parsed.command)
    assert seen == SUBCOMMANDS, f"commands the docs never show: {sorted(SUBCOMMANDS - seen)}"


# ------------------------------------------------------------------------ error examples

README = ROOT / "README.md"

# What each documented error line comes from: (command line, config file text, environment).
ErrorCase = tuple[list[str], str | None, dict[str, str]]
GENERIC = "scanners:\n  generic:\n"
ERROR_CASES: dict[Path, list[ErrorCase]] = {
    README: [
        (
            ["scan"],
            "kubelet_dri: /x\n" + GENERIC + "    - {resource: a.com/b, match: {subsystem: tty}}\n",
            {},
        ),
        (["scan"], "scanners:\n  gpu: {}\n", {}),
        (["scan"], GENERIC + "    - {resource: Serial, match: {subsystem: tty}}\n", {}),
    ],
    CONFIGURATION: [
        (["scan"], "hotplug: {coalesce: 3}\n", {}),
        (["scan"], "scanners:\n  gpu: {}\n", {}),
        (["scan"], GENERIC + "    - {match: {subsystem: tty}}\n", {}),
        (["scan"], GENERIC + "    - {resource: a.com/b, match: {}}\n", {}),
        (["scan"], GENERIC + "    - {resource: a.com/b, match: {subsystem: tty}, shares: 0}\n", {}),
        (
            ["scan"],
            GENERIC + "    - {resource: a.com/b, match: {subsystem: tty}, shares: true}\n",
            {},
        ),
        (["scan"], "scanners:\n  vfio: {allow_noiommu: 'yes'}\n", {}),
        (
            ["scan"],
            "scanners:\n  vfio:\n    devices:\n      - {selector: '8086:1572', resource: a.com/x}\n"
            "      - {selector: '8086:1572', resource: a.com/y}\n",
            {},
        ),
        (["scan"], "scanners:\n  intel_gpu: {allow_ids: [0x56c0]}\n", {}),
        (["scan", "--scanner", "generic"], None, {"DEVPLUG_LOG_LEVEL": "verbose"}),
        (["run", "--scanner", "generic", "--metrics-address", "foo"], None, {}),
        (["scan"], "scanners:\n  generic: []\nscanners:\n  vfio: {}\n", {}),
        (["scan"], "scanners:\n  generic: [\n", {}),
        (["scan", "--config", "nope.yaml"], None, {}),
        (["scan"], None, {"DEVPLUG_SCANNER": "gpu"}),
        (["scan"], None, {}),
    ],
}


def documented_errors(path: Path) -> list[str]:
    """The lines of the first plain block that lists ``devplug: configuration error:`` lines."""
    for language, lines in fenced_blocks(path.read_text()):
        found = [line for line in lines if line.startswith("devplug: configuration error: ")]
        if language == "" and len(found) > 1:
            return found
    raise AssertionError(f"no block of error examples in {path.name}")


def printed_error(
    case: ErrorCase,
    directory: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    from devplug.cli import main

    arguments, config, environment = case
    for name in [n for n in os.environ if n.startswith("DEVPLUG_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    if config is not None:
        (directory / "config.yaml").write_text(config)
        arguments = [*arguments, "--config", "config.yaml"]
    monkeypatch.chdir(directory)
    capsys.readouterr()
    logging = structlog.get_config()
    try:
        assert main(arguments) == 2, arguments
    finally:
        structlog.configure(**logging)  # main() pointed the logs at this test's capture
    (line,) = capsys.readouterr().err.splitlines()
    return line.replace(str(directory) + "/", "")


@pytest.mark.parametrize("path", sorted(ERROR_CASES), ids=lambda p: p.name)
def test_the_error_examples_are_what_devplug_prints(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    printed = [printed_error(case, tmp_path, capsys, monkeypatch) for case in ERROR_CASES[path]]
    assert documented_errors(path) == printed


@pytest.mark.parametrize(
    ("spelling", "accepted"),
    [("true", True), ("false", False), ("yes", True), ("no", False), ("on", True), ("off", False),
     ("'yes'", None), ("'true'", None), ("1", None), ("y", None)],
)  # fmt: skip
def test_allow_noiommu_takes_the_spellings_the_reference_gives(
    spelling: str, accepted: bool | None, tmp_path: Path
) -> None:
    from devplug.config import load_settings
    from devplug.errors import ConfigError
    from devplug.scanners.registry import build_scanners

    row = next(r for r in table_rows(CONFIGURATION.read_text()) if "allow_noiommu" in r[0])
    if accepted is not None:
        assert f"`{spelling}`" in row[1]
    config = tmp_path / "config.yaml"
    config.write_text(f"scanners:\n  vfio: {{allow_noiommu: {spelling}}}\n")
    settings = load_settings(config, {}, [], {})
    if accepted is None:
        with pytest.raises(ConfigError):
            build_scanners(settings.scanners)
    else:
        (scanner,) = build_scanners(settings.scanners)
        assert scanner.settings.allow_noiommu is accepted  # type: ignore[attr-defined]


# ------------------------------------------------------------------------ log format

CONSOLE_LINE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z \[(debug|info|warning|error)\s*\] [a-z_.]+ +"
    r"(\S+=.*)?"
)


def logged_line(log_format: str, tmp_path: Path) -> str:
    """The first line devplug logs in ``log_format`` (a warning for an entry matching nothing)."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "scanners:\n  generic:\n    - {resource: a.com/b, match: {subsystem: no-such}}\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "devplug",
            "scan",
            "--config",
            str(config),
            "--log-format",
            log_format,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()[0]


def log_example(log_format: str) -> str:
    text = OPERATIONS.read_text()
    block = text[text.index(f"- `log_format: {log_format}`") :]
    return fenced_blocks(block)[0][1][0]


def test_the_console_log_example_has_devplugs_format(tmp_path: Path) -> None:
    assert CONSOLE_LINE.fullmatch(logged_line("console", tmp_path))
    assert CONSOLE_LINE.fullmatch(log_example("console"))


def test_the_json_log_example_has_devplugs_keys(tmp_path: Path) -> None:
    import json

    real, documented = json.loads(logged_line("json", tmp_path)), json.loads(log_example("json"))
    assert list(real)[-3:] == list(documented)[-3:] == ["event", "level", "timestamp"]
    timestamp = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
    assert timestamp.fullmatch(real["timestamp"]) and timestamp.fullmatch(documented["timestamp"])


# ------------------------------------------------------------------------ log events

SRC = ROOT / "src" / "devplug"
DOC_PAGES = [README, *sorted(DOCS.glob("*.md"))]
DOTTED = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)+")
# An f-string's placeholder in an event name stands for one dotted segment (``{rpc}.refused``).
SEGMENT = "[a-z][a-z0-9_]*"
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "msg"}
LEVELS = "(?:debug|info|warning|error|critical)"
# The last segment of a file name or a domain name written in the docs (``config.yaml``,
# ``gpu.intel.com``): dotted like events, and neither.
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "md", "ini", "toml", "sock", "service", "proto"}
TOP_LEVEL_DOMAINS = {"com", "io", "org", "net"}
# Dotted names of other things the docs mention, by what they are.
NOT_EVENTS = {
    "loop.add_reader": "an asyncio event loop method",
    "grpc.keepalive_time_ms": "a gRPC channel option",
    "grpc.max_connection_idle_ms": "a gRPC channel option",
    "grpc.so_reuseport": "a gRPC server option",
    "fs.inotify.max_user_watches": "a sysctl",
    "capabilities.drop": "a field of a pod spec",
}


def _event_pattern(node: ast.expr) -> str | None:
    """The regular expression an event argument stands for: a string as it is, an f-string
    with each placeholder one segment; None for anything else (a variable passed along)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(
            re.escape(str(part.value)) if isinstance(part, ast.Constant) else SEGMENT
            for part in node.values
        )
    return None


def _assignments(scope: ast.AST) -> dict[str, list[ast.expr]]:
    """What each name in ``scope`` is assigned (``event = f"{rpc}.refused"``, and pairwise
    ``event, reason = f"...", str(exc)``)."""
    values: dict[str, list[ast.expr]] = {}
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                values.setdefault(target.id, []).append(node.value)
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for name, value in zip(target.elts, node.value.elts, strict=False):
                    if isinstance(name, ast.Name):
                        values.setdefault(name.id, []).append(value)
    return values


def _is_log_method(function: ast.expr, assigned: dict[str, list[ast.expr]]) -> bool:
    """``log.info``, ``self._log.warning``, or a name bound to one (``level = log.warning if
    ... else log.error``)."""
    if isinstance(function, ast.Attribute):
        return function.attr in LOG_METHODS
    if isinstance(function, ast.Name):
        return any(
            isinstance(inner, ast.Attribute) and inner.attr in LOG_METHODS
            for value in assigned.get(function.id, [])
            for inner in ast.walk(value)
        )
    return False


def emitted_event_patterns() -> set[str]:
    """Every event name src logs, as a regular expression: the first argument of a logger's
    method (called as an attribute, or through a name bound to one) and the event argument
    of ``ProblemLog.report(logger, event, ...)``; a name passed there stands for what it is
    assigned in its function or module."""
    found: set[str] = set()
    for path in SRC.rglob("*.py"):
        module = ast.parse(path.read_text(), str(path))
        module_values = _assignments(module)
        scopes: list[ast.AST] = [module]  # module-level calls; names as the module assigns
        scopes += [
            node
            for node in ast.walk(module)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        for scope in scopes:
            local = _assignments(scope)
            for node in ast.walk(scope):
                if not isinstance(node, ast.Call):
                    continue
                argument: ast.expr | None = None
                if isinstance(node.func, ast.Attribute) and node.func.attr == "report":
                    argument = node.args[1] if len(node.args) > 1 else None
                elif _is_log_method(node.func, local):
                    argument = node.args[0] if node.args else None
                if argument is None:
                    continue
                candidates = [argument]
                if isinstance(argument, ast.Name):
                    candidates = local.get(argument.id) or module_values.get(argument.id, [])
                for candidate in candidates:
                    pattern = _event_pattern(candidate)
                    # Shaped as an event, a placeholder taken as one segment (not a message).
                    if pattern is not None and DOTTED.fullmatch(
                        pattern.replace(SEGMENT, "x").replace("\\", "")
                    ):
                        found.add(pattern)
    return found


def _without_fences(text: str) -> tuple[str, list[str]]:
    """The prose of a page, and the lines of its fenced blocks."""
    prose: list[str] = []
    fenced: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            continue
        (fenced if inside else prose).append(line)
    return "\n".join(prose), fenced


def documented_dotted_names() -> dict[str, set[str]]:
    """Dotted names the docs write, by page: whole inline code spans (`scan.failed`), and the
    events of the log lines they show (JSON ``"event": ...``, console ``[info ] name``)."""
    names: dict[str, set[str]] = {}
    for page in DOC_PAGES:
        prose, fenced = _without_fences(page.read_text())
        found = {span for span in re.findall(r"`([^`\n]+)`", prose) if DOTTED.fullmatch(span)}
        for line in fenced:
            found.update(re.findall(r'"event": "([^"]+)"', line))
            # devplug's console format, and the in-test daemon's summary of its log lines
            found.update(re.findall(rf"Z \[{LEVELS}\s*\] +(\S+)", line))
            found.update(re.findall(rf"^\s*(\S+) \[{LEVELS}\]", line))
        names[page.name] = found
    return names


def _python_name(name: str) -> bool:
    """Whether ``name`` is a module or attribute path: devplug's own (``kubelet.seams`` is
    ``devplug.kubelet.seams``), a file of this repository (``bench.hotplug_stages``), or the
    standard library's (``json.dumps``)."""
    parts = name.split(".")
    for root in (ROOT, ROOT / "src", SRC):
        if root.joinpath(*parts).with_suffix(".py").is_file() or root.joinpath(*parts).is_dir():
            return True
    for start in ([*parts], ["devplug", *parts]):
        if start[0] not in sys.stdlib_module_names and start[0] != "devplug":
            continue
        for split in range(len(start), 0, -1):
            try:
                value: Any = importlib.import_module(".".join(start[:split]))
            except ImportError:
                continue
            for attribute in start[split:]:
                value = getattr(value, attribute, None)
            if value is not None:
                return True
            break
    return False


def not_an_event(name: str) -> str | None:
    """What a dotted name in the docs is, if it is not a log event (None: it claims to be one)."""
    settings = set(setting_paths())
    if name in settings or name.startswith("scanners."):
        return "a setting"
    last = name.rsplit(".", 1)[-1]
    if last in FILE_SUFFIXES:
        return "a file name"
    if last in TOP_LEVEL_DOMAINS:
        return "a domain name"
    if name in NOT_EVENTS:
        return NOT_EVENTS[name]
    if _python_name(name):
        return "a Python name"
    return None


def test_the_event_finder_sees_every_way_src_logs_an_event() -> None:
    patterns = [re.compile(p) for p in emitted_event_patterns()]

    def emitted(name: str) -> bool:
        return any(p.fullmatch(name) for p in patterns)

    assert len(patterns) > 60
    assert emitted("daemon.started")  # log.info("daemon.started", ...)
    assert emitted("kubelet.register.failed")  # through a local bound to log.warning
    assert emitted("scan.failed")  # ProblemLog.report(log, "scan.failed", ...)
    assert emitted("kubelet.dir.missing")  # f"{self.topic}.dir.missing"
    assert emitted("allocate.refused")  # f"{rpc}.refused"
    assert not emitted("intel_gpu.list_near_limit") and not emitted("scan")


def test_every_log_event_the_docs_name_is_logged_by_src() -> None:
    """Issue 25 item 3: an operator greps the log for the events the docs name. A dotted name
    in the docs that src never logs must be something else: a setting, a file, a domain, a
    Python name or one of NOT_EVENTS."""
    patterns = [re.compile(p) for p in emitted_event_patterns()]

    def emitted(name: str) -> bool:
        return any(p.fullmatch(name) for p in patterns)

    named = documented_dotted_names()
    every = {name for names in named.values() for name in names}
    # The finder sees events in prose, tables and log examples, and the other dotted names.
    assert {"scan.failed", "list_limit.devices_held_back", "kubelet.register.complete"} <= {
        name for name in every if emitted(name)
    }
    assert {"cdi.dir", "config.yaml", "kubelet.seams", "kubernetes.io"} <= every
    unexplained = {
        page: sorted(name for name in names if not emitted(name) and not_an_event(name) is None)
        for page, names in named.items()
    }
    unexplained = {page: names for page, names in unexplained.items() if names}
    assert not unexplained, f"log events the docs name that src never logs: {unexplained}"


# ------------------------------------------------------------------------ benchmarks

BENCH = ROOT / "bench"
# Modules of bench/ that are no benchmark of their own: shared code, and the processes a
# benchmark starts (floors, the traced daemon).
BENCH_HELPERS = {
    "__init__",
    "common",
    "floor_server",
    "list_floor",
    "monitor_floor",
    "traced_daemon",
}


def test_every_benchmark_has_its_command_on_the_benchmarks_page() -> None:
    """The figures' page names the command of each: a bench added without its figures, or a
    command naming a bench that is gone, fails here."""
    text = (DOCS / "benchmarks.md").read_text()
    documented = set(re.findall(r"-m bench\.(\w+)", text))
    benches = {path.stem for path in BENCH.glob("*.py")} - BENCH_HELPERS
    assert documented == benches, (
        f"no command on the page: {sorted(benches - documented)}; "
        f"no such bench: {sorted(documented - benches)}"
    )

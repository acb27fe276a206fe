"""What the command line needs before anything else loads: the command itself (so that ``run``
can guard its signals first) and the version line.

Flags may come before the command, as kubectl's and helm's do: ``devplug --config FILE scan``
is ``devplug scan --config FILE``. :func:`hoist` moves them after the command's words, where
that command's parser takes the flags it has and refuses the others. The options are listed
here rather than read off the parser, which would load it first; tests/test_cli.py checks that
the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from devplug._version import __version__

# The top-level parser's own options: left where they are (``devplug --help scan``).
TOP_LEVEL = frozenset({"-h", "--help", "--version"})
# The commands' options that take no value.
FLAGS = frozenset({"--dry-run", "--stdout", "--prune", "--pods"})
# The commands' options that take one value (``--config PATH``, ``-o json``, ``-ojson``).
VALUED = frozenset(
    {
        "--config",
        "--scanner",
        "--kubelet-dir",
        "--cdi-dir",
        "--metrics-address",
        "--log-format",
        "--log-level",
        "-o",
        "--output",
        "--output-dir",
        "--timeout",
        "--replay",
        "--keep",
        "--pod-resources-socket",
        "--reason",
    }
)
# Commands whose own commands follow them (``cdi generate``, ``dra deviceclasses``).
GROUPS = frozenset({"cdi", "dra"})
_LONG = sorted(name for name in TOP_LEVEL | FLAGS | VALUED if name.startswith("--"))


def version_line(program: str, version: str | None = None) -> str:
    """``devplug 0.1.0``; a plugin's entry point: ``misc-plugin 1.2.0 (devplug 0.1.0)``."""
    if version is None:
        return f"{program} {__version__}"
    return f"{program} {version} (devplug {__version__})"


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg not in ("-", "--")


def _option(arg: str) -> tuple[str | None, bool]:
    """The option ``arg`` names (a unique prefix of a long one, as argparse allows) or None,
    and whether its value is attached (``--config=x``, ``-ojson``)."""
    if arg.startswith("--"):
        given, attached = arg.split("=", 1)[0], "=" in arg
        matches = [name for name in _LONG if name.startswith(given)]
        if given in _LONG:
            return given, attached
        return (matches[0] if len(matches) == 1 else None), attached
    name = arg[:2]
    known = name in TOP_LEVEL or name in FLAGS or name in VALUED
    return (name if known else None), len(arg) > 2


def hoist(argv: Sequence[str]) -> list[str]:
    """``argv`` with the options before the command moved after its words: ``--config x scan
    -o json`` -> ``scan --config x -o json``. Left as it is when an option before the command
    is the top-level parser's own or unknown (argparse answers, or refuses it by name)."""
    args = list(argv)
    leading: list[str] = []
    index = 0
    while index < len(args) and _is_option(args[index]):
        name, attached = _option(args[index])
        if name is None or name in TOP_LEVEL:
            return args
        leading.append(args[index])
        index += 1
        if name in VALUED and not attached and index < len(args):
            leading.append(args[index])
            index += 1
    if not leading:
        return args
    words = args[index : index + 1]
    if words and words[0] in GROUPS and index + 1 < len(args) and not _is_option(args[index + 1]):
        words = args[index : index + 2]
    return [*words, *leading, *args[index + len(words) :]]


def command(argv: Sequence[str]) -> str | None:
    """The command word of a hoisted ``argv`` (None when it starts with an option)."""
    return argv[0] if argv and not _is_option(argv[0]) else None

"""Scanner names have one spelling: snake_case, as the config keys that hold their sections
(``scanners.intel_gpu``). The other spelling (``intel-gpu``, as command-line words often are)
is accepted wherever a name is given (``--scanner``, ``DEVPLUG_SCANNER``, a ``scanners:`` key)
and noted as a :class:`Respelling`, which :func:`log_respellings` turns into a one-line hint
once logging is configured (a name is read before it is)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

SCANNER_NAME = re.compile(r"[a-z][a-z0-9_]*")


def scanner_name(given: str) -> str:
    """The one spelling of the scanner name ``given``: ``intel-gpu`` -> ``intel_gpu``."""
    return given.replace("-", "_")


def scanner_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a scanner's name (a plugin author's factory key), or None."""
    if SCANNER_NAME.fullmatch(name) is None:
        return (
            f"scanner name {name!r} must be snake_case (a config key: lower-case letters, "
            f"digits and '_', starting with a letter), e.g. {scanner_name(name).lower()!r}"
        )
    return None


@dataclass(frozen=True, slots=True)
class Respelling:
    """A scanner name given in the other spelling, and accepted."""

    source: str  # where it was given: "--scanner", "DEVPLUG_SCANNER", "scanners.intel-gpu"
    given: str
    name: str

    @property
    def hint(self) -> str:
        return f"scanner names are written with '_', as config keys: write {self.name}"


def log_respellings(respellings: Iterable[Respelling]) -> None:
    """One warning per name given in the other spelling (logging must be configured)."""
    import structlog

    log = structlog.get_logger(__name__)
    for respelling in respellings:
        log.warning(
            "config.scanner.spelling",
            source=respelling.source,
            given=respelling.given,
            name=respelling.name,
            hint=respelling.hint,
        )

"""pydantic's validation errors as ConfigErrors: a dotted field (or the variable or flag the
value came from), one line of text without pydantic's prefixes or regular expressions, and the
closest valid key for a misspelt one."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ValidationError

from devplug.errors import ConfigError


def _join(location: Sequence[int | str]) -> str:
    out = ""
    for part in location:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# pydantic's prefixes of messages raised by validators ("Value error, must be ...").
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def config_error(
    exc: ValidationError,
    prefix: str = "",
    model: type[BaseModel] | None = None,
    sources: Mapping[str, str] | None = None,
) -> ConfigError:
    """Turn pydantic's first error into a ConfigError with a dotted field path and a hint.

    ``sources`` maps a dotted field to where its value came from when that was not the config
    file (``DEVPLUG_LOG_LEVEL``, ``--kubelet-dir``): the error names that instead.
    """
    first = exc.errors(include_url=False)[0]
    location = list(first["loc"])
    field = _join([prefix, *location] if prefix else location)
    if sources and field in sources:
        field = sources[field]
    message = str(first["msg"])
    for pydantic_prefix in _PYDANTIC_PREFIXES:
        message = message.removeprefix(pydantic_prefix)
    if first["type"] == "string_pattern_mismatch":
        # pydantic's text is the regular expression itself.
        message = f"is not a valid value here (got {first['input']!r})"
    elif first["type"] == "extra_forbidden":
        known = _known_keys(model, location[:-1]) if model is not None else []
        message = "unknown setting"
        if known:
            close = difflib.get_close_matches(str(location[-1]), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ";"
            message += f"{hint} valid keys here: {', '.join(known)}"
    elif first["type"] == "missing":
        message = "is required"
    elif "input" in first and first["type"] not in ("value_error", "assertion_error"):
        message += f" (got {first['input']!r})"
    return ConfigError(field, message)


def _known_keys(model: type[BaseModel], location: Sequence[int | str]) -> list[str]:
    """Field names of the (possibly nested) model at ``location``."""
    current = model
    for part in location:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        candidates = [annotation, *args, *(a for arg in args for a in getattr(arg, "__args__", ()))]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return []
        current = nested[0]
    return sorted(current.model_fields)

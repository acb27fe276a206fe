"""Validation errors shaped like the API server's, and typed access to untrusted JSON.

:class:`FieldError` carries what one entry of a 422 Status's ``details.causes`` carries:
``field`` in ``field.Path`` syntax (``spec.devices[3].attributes[model].string``), ``reason``
(``FieldValueInvalid``, ``FieldValueTooLong``, ...) and ``message`` built the way
k8s.io/apimachinery ``pkg/util/validation/field/errors.go`` ``ErrorBody`` builds it
(``Invalid value: "x": <detail>``, ``Too long: may not be more than 64 bytes``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem: ``field`` (``spec.devices[0].name``), ``reason`` and ``message``."""

    field: str
    reason: str
    message: str

    def cause(self) -> dict[str, str]:
        """The ``details.causes`` entry of a 422 Status."""
        return {"reason": self.reason, "message": self.message, "field": self.field}

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


_OMIT = object()  # the error types whose body shows no value (Required, TooLong, Forbidden)


def _show(value: Any) -> str:
    """A bad value as ErrorBody prints it: %v for numbers and booleans, %q for strings
    (JSON quoting is the same for what devplug sends), JSON for the rest."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def _error(reason: str, title: str, path: str, value: Any, detail: str) -> FieldError:
    body = title if value is _OMIT else f"{title}: {_show(value)}"
    return FieldError(path, reason, f"{body}: {detail}" if detail else body)


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return _error("FieldValueInvalid", "Invalid value", path, value, detail)


def required(path: str, detail: str = "") -> FieldError:
    return _error("FieldValueRequired", "Required value", path, _OMIT, detail)


def too_long(path: str, limit: int) -> FieldError:
    detail = f"may not be more than {limit} byte{'' if limit == 1 else 's'}"
    return _error("FieldValueTooLong", "Too long", path, _OMIT, detail)


def too_many(path: str, count: int, limit: int) -> FieldError:
    detail = f"must have at most {limit} item{'' if limit == 1 else 's'}"
    return _error("FieldValueTooMany", "Too many", path, count, detail)


def duplicate(path: str, value: Any) -> FieldError:
    return _error("FieldValueDuplicate", "Duplicate value", path, value, "")


def forbidden(path: str, detail: str) -> FieldError:
    return _error("FieldValueForbidden", "Forbidden", path, _OMIT, detail)


def not_supported(path: str, value: Any, valid: Iterable[str]) -> FieldError:
    detail = "supported values: " + ", ".join(json.dumps(v) for v in valid)
    return _error("FieldValueNotSupported", "Unsupported value", path, value, detail)


def type_invalid(path: str, value: Any, expected: str) -> FieldError:
    """A value of the wrong JSON type (the API server refuses it while decoding)."""
    return _error("FieldValueTypeInvalid", "Invalid value", path, value, f"must be {expected}")


def each(path: str, value: str, messages: Iterable[str]) -> list[FieldError]:
    """One Invalid per message of a format check (``for _, msg := range IsX(v)``)."""
    return [invalid(path, value, message) for message in messages]


# ------------------------------------------------------------------ paths


def child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def index(path: str, position: int) -> str:
    return f"{path}[{position}]"


def key(path: str, name: str, limit: int) -> str:
    """``path[name]``; a name over ``limit`` characters (16 at least) is cut in the middle,
    as ``truncateIfTooLong`` does for map keys."""
    limit = max(limit, 16)
    if len(name) > limit:
        remaining = limit - 3
        name = name[: (remaining + 1) // 2] + "..." + name[len(name) - remaining // 2 :]
    return f"{path}[{name}]"


# ------------------------------------------------------------------ typed access


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_string(value: Any, path: str, errors: list[FieldError]) -> str | None:
    if isinstance(value, str):
        return value
    errors.append(type_invalid(path, value, "a string"))
    return None


def as_object(value: Any, path: str, errors: list[FieldError]) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping):
        return value
    errors.append(type_invalid(path, value, "an object"))
    return None


def as_list(value: Any, path: str, errors: list[FieldError]) -> list[Any]:
    """The list at ``path``; an absent (None) one is empty."""
    if value is None:
        return []
    if isinstance(value, list):
        return value
    errors.append(type_invalid(path, value, "a list"))
    return []


def dig(value: Any, keys: Iterable[str]) -> Any:
    """``value[k1][k2]...``, or None where a level is missing or not an object."""
    for name in keys:
        value = value.get(name) if isinstance(value, Mapping) else None
    return value

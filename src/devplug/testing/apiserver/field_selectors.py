"""Field selectors as the API server parses and applies them: ``field=value``,
``field==value`` and ``field!=value`` terms joined by ``,`` (AND), with backslash escapes
(apimachinery ``pkg/fields/selector.go`` ParseSelector), over the fields each kind makes
selectable (``pkg/registry/resource/resourceslice/strategy.go`` toSelectableFields; an
unsupported field is a 400, ``pkg/apis/resource/v1/conversion.go``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devplug.testing.apiserver.status import SLICES, Kind, bad_request

# Field selectors a 1.34-1.36 API server takes for ResourceSlices (pkg/apis/resource/v1/
# conversion.go). spec.pool.name came later (kubernetes/kubernetes#138456, merged 2026); before
# that the server answers 400 "field label not supported", and clients filter pools themselves.
SLICE_FIELD_LABELS = frozenset({"metadata.name", "spec.nodeName", "spec.driver"})
POOL_NAME_FIELD_LABEL = "spec.pool.name"


@dataclass(frozen=True, slots=True)
class FieldSelector:
    """A parsed ``fieldSelector``: terms ``field=value``, ``field==value``, ``field!=value``
    joined by ``,`` (AND), backslash escapes as in apimachinery ``fields.ParseSelector``."""

    terms: tuple[tuple[str, str, str], ...] = ()  # (field, "=" or "!=", value)

    @classmethod
    def parse(cls, text: str | None, allowed: Iterable[str], kind: Kind) -> FieldSelector:
        if not text:
            return cls()
        allowed = frozenset(allowed)
        terms = []
        for raw in _split_unescaped(text, ","):
            if not raw:
                continue
            field, op, value = _split_term(raw)
            if field not in allowed:
                raise bad_request(
                    f"field label not supported for {kind.api_version}, Kind={kind.kind}: {field}"
                )
            terms.append((field, op, value))
        return cls(tuple(terms))

    def matches(self, fields: Mapping[str, str]) -> bool:
        for field, op, value in self.terms:
            if (fields.get(field, "") == value) != (op == "="):
                return False
        return True

    @property
    def empty(self) -> bool:
        return not self.terms


def _split_unescaped(text: str, separator: str) -> list[str]:
    parts, current, escaped = [], "", False
    for char in text:
        if escaped:
            current += "\\" + char
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == separator:
            parts.append(current)
            current = ""
        else:
            current += char
    if escaped:
        current += "\\"
    parts.append(current)
    return parts


def _split_term(term: str) -> tuple[str, str, str]:
    for op, meaning in (("!=", "!="), ("==", "="), ("=", "=")):
        index = _find_unescaped(term, op)
        if index >= 0:
            field, value = term[:index], term[index + len(op) :]
            return field.strip(), meaning, _unescape(value)
    raise bad_request(f"invalid selector: '{term}'; can't understand '{term}'")


def _find_unescaped(text: str, needle: str) -> int:
    index, escaped = 0, False
    while index < len(text):
        if escaped:
            escaped = False
        elif text[index] == "\\":
            escaped = True
        elif text.startswith(needle, index):
            return index
        index += 1
    return -1


def _unescape(value: str) -> str:
    out, escaped = "", False
    for char in value:
        if escaped:
            if char not in "\\,=":
                raise bad_request(f"invalid field selector: invalid escape sequence '\\{char}'")
            out += char
            escaped = False
        elif char == "\\":
            escaped = True
        else:
            out += char
    if escaped:
        raise bad_request("invalid field selector: unterminated escape sequence")
    return out


def selectable_fields(kind: Kind, obj: Mapping[str, Any]) -> dict[str, str]:
    """What a field selector can see of ``obj`` (resourceslice strategy toSelectableFields)."""
    meta = obj.get("metadata") or {}
    fields = {"metadata.name": str(meta.get("name", ""))}
    if kind.namespaced:
        fields["metadata.namespace"] = str(meta.get("namespace", ""))
    if kind == SLICES:
        spec = obj.get("spec") or {}
        fields["spec.nodeName"] = str(spec.get("nodeName") or "")
        fields["spec.driver"] = str(spec.get("driver") or "")
        fields[POOL_NAME_FIELD_LABEL] = str((spec.get("pool") or {}).get("name") or "")
    return fields

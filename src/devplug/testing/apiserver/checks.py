"""What the stand-in API server checks before it stores a write, in the real server's order:
the structure first (a real server refuses those while decoding, so validation never sees
them), then the semantic rules, and on update the fields that never change
(kubernetes/kubernetes ``pkg/apis/resource/validation/validation.go``
ValidateResourceSliceUpdate: driver, pool name and node name are immutable)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from devplug.testing.apiserver.schema import StructuralSchema
from devplug.testing.apiserver.status import SLICES, Cause, JsonObject, Kind


class FieldProblem(Protocol):
    """What a semantic validator reports: ``devplug.dra.validate.FieldError`` has this shape."""

    @property
    def field(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def message(self) -> str: ...


SliceValidator = Callable[[Any], Sequence[FieldProblem]]

_IMMUTABLE = (("spec", "driver"), ("spec", "pool", "name"), ("spec", "nodeName"))


class WriteChecks:
    """The causes of a 422 for a create (``old`` None) or an update; empty when it is fine."""

    def __init__(
        self, schema: StructuralSchema | None, slice_validator: SliceValidator | None
    ) -> None:
        self.schema = schema
        self.slice_validator = slice_validator

    def __call__(self, kind: Kind, new: JsonObject, old: JsonObject | None) -> list[Cause]:
        if self.schema is not None:
            structural = self.schema.problems(kind, new)
            if structural:
                return structural
        if kind != SLICES:
            return []
        causes = immutable_changes(new, old) if old is not None else []
        if self.slice_validator is not None:
            problems = self.slice_validator(new)
            causes.extend(Cause(p.field, p.reason, p.message) for p in problems)
        return causes


def immutable_changes(new: JsonObject, old: JsonObject) -> list[Cause]:
    causes = []
    for path in _IMMUTABLE:
        after = _dig(new, path)
        if _dig(old, path) != after:
            shown = json.dumps(after)  # null when the field went away
            message = f"Invalid value: {shown}: field is immutable"
            causes.append(Cause(".".join(path), "FieldValueInvalid", message))
    return causes


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj

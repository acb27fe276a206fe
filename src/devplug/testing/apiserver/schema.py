"""The structural check: an object against the strict OpenAPI-derived JSON schema of its kind,
from the ``kubernetes-validate`` package, as field causes.

A real API server finds these problems while decoding: it drops unknown fields with a warning
(or refuses them with ``fieldValidation=Strict``) and answers a wrong type with 400. The
stand-in refuses all of them with 422 and one cause each: a field the server would drop
silently is a bug the driver should not ship.

``kubernetes-validate`` is in devplug's ``[test]`` extra. A plugin author without it gets a
clear error when starting the stand-in with a schema version, and can pass
``schema_version=None`` to keep only the semantic rules.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from devplug.testing.apiserver.status import Cause, Kind

DEFAULT_SCHEMA_VERSION = "1.34.0"
_PACKAGE = "kubernetes-validate"


class SchemaUnavailableError(RuntimeError):
    """The schemas for the asked version cannot be loaded (package missing, unknown version)."""


class StructuralSchema:
    """Validators for the kinds the stand-in takes, built once per Kubernetes version."""

    def __init__(self, version: str) -> None:
        self.version = version.removeprefix("v")
        self._utils, self._jsonschema, self._referencing = _modules()
        known = sorted(set(self._utils.all_versions()))
        if self.version not in known:
            raise SchemaUnavailableError(
                f"{_PACKAGE} has no schemas for Kubernetes {self.version}; "
                f"it has: {', '.join(known)}"
            )
        self._dir = f"kubernetes-json-schema/v{self.version}-local-strict"
        definitions = self._utils.schema_contents(f"{self._dir}/_definitions.json", self.version)
        resource = self._referencing.Resource.from_contents(definitions)
        self._registry = resource @ self._referencing.Registry()
        self._validators: dict[Kind, Any] = {}

    def problems(self, kind: Kind, obj: Mapping[str, Any]) -> list[Cause]:
        """Every structural problem of ``obj``, sorted by field."""
        validator = self._validator(kind)
        causes = [cause for error in validator.iter_errors(obj) for cause in _causes(error)]
        return sorted(causes, key=lambda cause: cause.field)

    def _validator(self, kind: Kind) -> Any:
        validator = self._validators.get(kind)
        if validator is None:
            group = kind.group.split(".")[0] if kind.group else "core"
            name = f"{self._dir}/{kind.kind.lower()}-{group}-{kind.version}.json"
            schema = self._utils.schema_contents(name, self.version)
            registry = self._referencing.Resource.from_contents(schema) @ self._registry
            validator = self._jsonschema.validators.Draft202012Validator(schema, registry=registry)
            self._validators[kind] = validator
        return validator


@functools.cache
def structural_schema(version: str) -> StructuralSchema:
    """One loaded schema set per version for the whole process (the definitions file is 1.5 MB
    of JSON: loading it takes most of a second on a busy machine)."""
    return StructuralSchema(version)


def _modules() -> tuple[Any, Any, Any]:
    try:
        utils = importlib.import_module("kubernetes_validate.utils")
        jsonschema = importlib.import_module("jsonschema")
        referencing = importlib.import_module("referencing")
    except ImportError as exc:
        raise SchemaUnavailableError(
            f"structural validation needs the {_PACKAGE} package ({exc.name} is missing): "
            f"install devplug's test extra (pip install 'devplug[test]'), or pass "
            f"schema_version=None to check only the API server's semantic rules"
        ) from None
    return utils, jsonschema, referencing


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _causes(error: Any) -> list[Cause]:
    """One jsonschema error as the causes an API server would list."""
    field = _path(error.absolute_path)
    kind = error.validator
    if kind == "additionalProperties" and isinstance(error.instance, Mapping):
        known = set(error.schema.get("properties", {}))
        extra = [key for key in error.instance if key not in known]
        return [
            Cause(_join(field, key), "FieldValueInvalid", f'unknown field "{_join(field, key)}"')
            for key in extra
        ]
    if kind == "required" and isinstance(error.instance, Mapping):
        missing = [key for key in error.validator_value if key not in error.instance]
        return [Cause(_join(field, key), "FieldValueRequired", "Required value") for key in missing]
    if kind == "type":
        expected = error.validator_value
        wanted = " or ".join(expected) if isinstance(expected, list) else str(expected)
        message = f"Invalid value: {error.instance!r}: must be of type {wanted}"
        return [Cause(field, "FieldValueTypeInvalid", message)]
    if kind == "enum":
        allowed = ", ".join(f'"{value}"' for value in error.validator_value if value is not None)
        message = f"Unsupported value: {error.instance!r}: supported values: {allowed}"
        return [Cause(field, "FieldValueNotSupported", message)]
    return [Cause(field, "FieldValueInvalid", f"Invalid value: {error.message}")]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key

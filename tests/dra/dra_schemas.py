"""The official structural schemas of ``resource.k8s.io/v1`` ResourceSlice, strict variant,
from ``kubernetes-validate``, for Kubernetes 1.34.0 to 1.37.0.

``kubernetes_validate.utils.validate`` reads 1.5 MB of definitions from disk at every call; a
property test checks thousands of slices, so the same files are compiled here once per
version, the way that function does it (a Draft 2020-12 validator with a referencing
registry). ``test_dra_schemas_agree_with_kubernetes_validate`` keeps the two in step.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from kubernetes_validate import utils as kubernetes_validate

# jsonschema ships no type stubs; through importlib it is plainly Any.
jsonschema: Any = importlib.import_module("jsonschema")
referencing: Any = importlib.import_module("referencing")

VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")


@functools.cache
def _validator(version: str) -> Any:
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kubernetes_validate.schema_contents(
        f"{folder}/resourceslice-resource-v1.json", version
    )
    definitions = kubernetes_validate.schema_contents(f"{folder}/_definitions.json", version)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def schema_errors(obj: Any, version: str) -> list[str]:
    """What the strict schema of ``version`` says against ``obj`` (empty: it passes)."""
    return [
        f"{'/'.join(str(part) for part in error.absolute_path)}: {error.message}"
        for error in _validator(version).iter_errors(obj)
    ]


def all_schema_errors(obj: Any) -> dict[str, list[str]]:
    """Per version, the strict schema's errors; only versions with errors are listed."""
    found = {version: schema_errors(obj, version) for version in VERSIONS}
    return {version: errors for version, errors in found.items() if errors}

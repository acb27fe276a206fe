"""The official structural schemas of ``resource.k8s.io/v1`` ResourceSlice, strict variant,
from ``kubernetes-validate``, for Kubernetes 1.34.0 to 1.37.0.

Through the API-server stand-in's loader (:mod:`devplug.testing.apischema`), which compiles
each version's schemas once: ``kubernetes_validate.utils.validate`` reads 1.5 MB of
definitions at every call, and a property test checks thousands of slices.
``test_dra_schemas_agree_with_kubernetes_validate`` keeps the two in step.
"""

from __future__ import annotations

from typing import Any

from devplug.testing.apischema import structural_schema
from devplug.testing.apistore import SLICES

VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")


def schema_errors(obj: Any, version: str) -> list[str]:
    """What the strict schema of ``version`` says against ``obj`` (empty: it passes)."""
    return [f"{c.field}: {c.message}" for c in structural_schema(version).problems(SLICES, obj)]


def all_schema_errors(obj: Any) -> dict[str, list[str]]:
    """Per version, the strict schema's errors; only versions with errors are listed."""
    found = {version: schema_errors(obj, version) for version in VERSIONS}
    return {version: errors for version, errors in found.items() if errors}

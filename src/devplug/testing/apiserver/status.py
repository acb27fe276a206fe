"""The vocabulary of the stand-in API server's answers: the kinds it serves, and errors as the
``Status`` objects a real server sends (texts from kubernetes/kubernetes
``staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go`` and the registry that raises them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JsonObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Kind:
    """A REST resource the stand-in serves."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How errors name the resource: ``resourceslices.resource.k8s.io``, ``nodes``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


SLICES = Kind("resource.k8s.io", "v1", "ResourceSlice", "resourceslices", namespaced=False)
CLAIMS = Kind("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims", namespaced=True)
NODES = Kind("", "v1", "Node", "nodes", namespaced=False)

OPTIMISTIC_LOCK_MESSAGE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


class StatusError(Exception):
    """An answer the API server gives as a ``Status`` (kind Status, status Failure)."""

    def __init__(
        self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> JsonObject:
        body: JsonObject = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
        }
        if self.reason:  # StatusReasonUnknown is "" and omitted
            body["reason"] = self.reason
        if self.details:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(kind: Kind, name: str, *, use_kind: bool = False) -> JsonObject:
    details: JsonObject = {"name": name}
    if kind.group:
        details["group"] = kind.group
    details["kind"] = kind.kind if use_kind else kind.plural
    return details


def not_found(kind: Kind, name: str) -> StatusError:
    return StatusError(
        404, "NotFound", f'{kind.qualified} "{name}" not found', _details(kind, name)
    )


def already_exists(kind: Kind, name: str) -> StatusError:
    message = f'{kind.qualified} "{name}" already exists'
    return StatusError(409, "AlreadyExists", message, _details(kind, name))


def conflict(kind: Kind, name: str, why: str) -> StatusError:
    message = f'Operation cannot be fulfilled on {kind.qualified} "{name}": {why}'
    return StatusError(409, "Conflict", message, _details(kind, name))


def precondition_failed(kind: Kind, name: str, what: str, wanted: str, actual: str) -> StatusError:
    """storage.Preconditions.Check, as the registry reports it (a Conflict)."""
    why = f"Precondition failed: {what} in precondition: {wanted}, {what} in object meta: {actual}"
    return conflict(kind, name, why)


def bad_request(message: str) -> StatusError:
    return StatusError(400, "BadRequest", message)


def expired(message: str) -> StatusError:
    return StatusError(410, "Expired", message)


@dataclass(frozen=True, slots=True)
class Cause:
    """One ``details.causes`` entry of a 422: ``field`` (``spec.devices[0].name``), ``reason``
    (``FieldValueInvalid``, ...) and ``message`` (the error body, without the field)."""

    field: str
    reason: str
    message: str


def invalid(kind: Kind, name: str, causes: Sequence[Cause]) -> StatusError:
    """errors.NewInvalid: the message aggregates ``field: message`` (in brackets when several)."""
    texts = [f"{c.field}: {c.message}" if c.field else c.message for c in causes]
    listed = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    group_kind = f"{kind.kind}.{kind.group}" if kind.group else kind.kind
    details = _details(kind, name, use_kind=True)
    details["causes"] = [
        {"reason": c.reason, "message": c.message, "field": c.field} for c in causes
    ]
    return StatusError(422, "Invalid", f'{group_kind} "{name}" is invalid: {listed}', details)

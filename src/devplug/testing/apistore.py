"""What the stand-in API server stores and how a real one treats it: server-set metadata, one
resourceVersion counter, optimistic concurrency, preconditions, field selectors, the watch
history, and errors as ``Status`` objects. No I/O here: :mod:`devplug.testing.apiserver` puts
HTTP in front.

Each rule is the real API server's, read in kubernetes/kubernetes (``staging/src/k8s.io/``
``apiserver/pkg/registry/generic/registry/store.go``: Create, Update, Delete, DeleteCollection;
``apiserver/pkg/registry/rest/create.go`` and ``update.go``: BeforeCreate/BeforeUpdate;
``apiserver/pkg/storage/interfaces.go``: Preconditions.Check; ``apiserver/pkg/storage/``
``names/generate.go``: generateName; ``apimachinery/pkg/api/errors/errors.go``: the Status
texts; ``pkg/registry/resource/resourceslice/strategy.go``: generation; ``pkg/apis/resource/``
``v1/conversion.go``: the selectable fields). Objects are JSON dicts; a stored dict is never
changed in place (an update stores a new one), so lists and events can share them.
"""

from __future__ import annotations

import base64
import copy
import json
import secrets
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from devplug._kits.values import LatestValue

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

# Field selectors a 1.34-1.36 API server takes for ResourceSlices (pkg/apis/resource/v1/
# conversion.go). spec.pool.name came later (kubernetes/kubernetes#138456, merged 2026); before
# that the server answers 400 "field label not supported", and clients filter pools themselves.
SLICE_FIELD_LABELS = frozenset({"metadata.name", "spec.nodeName", "spec.driver"})
POOL_NAME_FIELD_LABEL = "spec.pool.name"

OPTIMISTIC_LOCK_MESSAGE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)
# names.SimpleNameGenerator: 5 characters from utilrand's alphabet (no vowels, no 0/1/3).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_NAME_SUFFIX = 5
_NAME_MAX = 63
_GENERATE_ATTEMPTS = 8  # store.go maxNameGenerationCreateAttempts (RetryGenerateName, GA 1.32)
_CONTINUATIONS_KEPT = 64


# ------------------------------------------------------------------ errors as Status objects


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


# ------------------------------------------------------------------ field selectors


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


# ------------------------------------------------------------------ the store


@dataclass(frozen=True, slots=True)
class Event:
    """One change, as a watch sends it: ``type`` ADDED/MODIFIED/DELETED at ``rv``."""

    rv: int
    kind: Kind
    type: str
    object: JsonObject


Validator = Callable[[Kind, JsonObject, JsonObject | None], list[Cause]]


def _no_problems(kind: Kind, new: JsonObject, old: JsonObject | None) -> list[Cause]:
    return []


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(kind: Kind, namespace: str, name: str) -> tuple[Kind, str, str]:
    return (kind, namespace if kind.namespaced else "", name)


class Store:
    """Objects by kind, namespace and name, with the API server's write rules.

    ``history`` bounds the events kept for watches; a watch from an older resourceVersion gets
    410 Expired, as from a real server after etcd compaction.
    """

    def __init__(self, *, history: int = 1000, validate: Validator = _no_problems) -> None:
        self._objects: dict[tuple[Kind, str, str], JsonObject] = {}
        self._log: deque[Event] = deque()
        self._history = history
        self._compacted = 0  # events at or below this rv are gone
        self._continuations: dict[str, tuple[int, list[JsonObject]]] = {}
        self.validate = validate
        self.rv = 1
        self.changed: LatestValue[int] = LatestValue(self.rv)

    # ---------------------------------------------------------------- reads

    def get(self, kind: Kind, namespace: str, name: str) -> JsonObject:
        obj = self._objects.get(_key(kind, namespace, name))
        if obj is None:
            raise not_found(kind, name)
        return obj

    def find(self, kind: Kind, namespace: str, name: str) -> JsonObject | None:
        return self._objects.get(_key(kind, namespace, name))

    def items(self, kind: Kind, selector: FieldSelector | None = None) -> list[JsonObject]:
        """Objects of ``kind`` matching ``selector``, in the order etcd lists keys (by namespace
        and name)."""
        found = [
            (key[1], key[2], obj)
            for key, obj in self._objects.items()
            if key[0] == kind
            and (selector is None or selector.matches(selectable_fields(kind, obj)))
        ]
        return [obj for _, _, obj in sorted(found, key=lambda entry: (entry[0], entry[1]))]

    def page(
        self, kind: Kind, selector: FieldSelector, limit: int, token: str | None
    ) -> tuple[int, list[JsonObject], str | None, int | None]:
        """One page of a list: (rv, items, continue token, remainingItemCount). Later pages come
        from the snapshot the first one took, as etcd serves them at the first page's revision."""
        if token:
            taken = self._continuations.pop(token, None)
            if taken is None:
                raise expired(
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter."
                )
            rv, rest = taken
        else:
            rv, rest = self.rv, self.items(kind, selector)
        if limit <= 0 or len(rest) <= limit:
            return rv, rest, None, None
        page, rest = rest[:limit], rest[limit:]
        next_name = rest[0]["metadata"]["name"]
        raw = json.dumps({"rv": rv, "start": next_name, "n": secrets.token_hex(4)})
        token = base64.urlsafe_b64encode(raw.encode()).decode()
        self._continuations[token] = (rv, rest)
        while len(self._continuations) > _CONTINUATIONS_KEPT:
            del self._continuations[next(iter(self._continuations))]
        # remainingItemCount is only known when nothing filters (store.go, etcd3 GetList).
        return rv, page, token, (len(rest) if selector.empty else None)

    def events_since(self, rv: int, kind: Kind) -> list[Event]:
        """Events of ``kind`` after ``rv``; 410 Expired when history before them is gone."""
        if rv < self._compacted:
            raise expired(f"too old resource version: {rv} ({self._compacted})")
        return [event for event in self._log if event.rv > rv and event.kind == kind]

    # ---------------------------------------------------------------- writes

    def create(self, kind: Kind, body: JsonObject) -> JsonObject:
        obj = _with_type(kind, body)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            # etcd3 store.Create returns a plain error; the handler answers 500 with no reason.
            raise StatusError(500, "", "resourceVersion should not be set on objects to be created")
        if not kind.namespaced:
            meta.pop("namespace", None)
        for server_set in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"):
            meta.pop(server_set, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        namespace = str(meta.get("namespace", ""))
        if meta.get("name"):
            name = str(meta["name"])
            self._check(kind, name, obj, None)
            if self.find(kind, namespace, name) is not None:
                raise already_exists(kind, name)
        elif meta.get("generateName"):
            for attempt in range(_GENERATE_ATTEMPTS):
                name = meta["name"] = _generate_name(str(meta["generateName"]))
                if attempt == 0:
                    self._check(kind, name, obj, None)
                if self.find(kind, namespace, name) is None:
                    break
            else:
                raise already_exists(kind, name)
        else:
            required = "Required value: name or generateName is required"
            raise invalid(kind, "", [Cause("metadata.name", "FieldValueRequired", required)])
        return self._write(kind, namespace, name, obj, "ADDED")

    def update(self, kind: Kind, namespace: str, name: str, body: JsonObject) -> JsonObject:
        obj = _with_type(kind, body)
        meta = obj["metadata"]
        if meta.get("name") != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                f"({name})"
            )
        old = self.get(kind, namespace, name)
        old_meta = old["metadata"]
        sent_rv = meta.get("resourceVersion")
        if sent_rv and sent_rv != old_meta["resourceVersion"]:
            raise conflict(kind, name, OPTIMISTIC_LOCK_MESSAGE)
        sent_uid = meta.get("uid")
        if sent_uid and sent_uid != old_meta["uid"]:
            raise precondition_failed(kind, name, "UID", sent_uid, old_meta["uid"])
        if not kind.namespaced:
            meta.pop("namespace", None)
        for kept in ("uid", "creationTimestamp", "generation"):
            meta[kept] = old_meta[kept]
        meta.pop("managedFields", None)
        if obj.get("spec") != old.get("spec"):
            meta["generation"] = old_meta["generation"] + 1
        self._check(kind, name, obj, old)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if obj == old:
            return old  # GuaranteedUpdate writes nothing when the bytes are the same
        return self._write(kind, namespace, name, obj, "MODIFIED")

    def delete(
        self, kind: Kind, namespace: str, name: str, preconditions: Mapping[str, Any] | None = None
    ) -> JsonObject:
        old = self.get(kind, namespace, name)
        meta = old["metadata"]
        preconditions = preconditions or {}
        uid, rv = preconditions.get("uid"), preconditions.get("resourceVersion")
        if uid is not None and uid != meta["uid"]:
            raise precondition_failed(kind, name, "UID", uid, meta["uid"])
        if rv is not None and rv != meta["resourceVersion"]:
            raise precondition_failed(kind, name, "ResourceVersion", rv, meta["resourceVersion"])
        del self._objects[_key(kind, namespace, name)]
        # A watch's DELETED object is the last state, at the revision of the delete.
        self.rv += 1
        gone = {**old, "metadata": {**meta, "resourceVersion": str(self.rv)}}
        self._record(Event(self.rv, kind, "DELETED", gone))
        return gone

    def delete_collection(self, kind: Kind, selector: FieldSelector) -> list[JsonObject]:
        """DeleteCollection: each match deleted on its own (one event and revision each)."""
        deleted = []
        for obj in self.items(kind, selector):
            meta = obj["metadata"]
            deleted.append(self.delete(kind, str(meta.get("namespace", "")), str(meta["name"])))
        return deleted

    def put(self, kind: Kind, body: JsonObject) -> JsonObject:
        """Create or overwrite without the client-facing checks (test fixtures: claims as the
        scheduler writes them, nodes as the kubelet registers them)."""
        obj = _with_type(kind, body)
        meta = obj["metadata"]
        name, namespace = str(meta["name"]), str(meta.get("namespace", ""))
        old = self.find(kind, namespace, name)
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta.setdefault("generation", 1)
        else:
            meta.setdefault("uid", old["metadata"]["uid"])
            meta.setdefault("creationTimestamp", old["metadata"]["creationTimestamp"])
            meta.setdefault("generation", old["metadata"].get("generation", 1))
        meta.pop("resourceVersion", None)
        return self._write(kind, namespace, name, obj, "ADDED" if old is None else "MODIFIED")

    def compact(self) -> None:
        """Forget every event and list continuation so far, as etcd compaction does."""
        self._log.clear()
        self._continuations.clear()
        self._compacted = self.rv

    def _check(self, kind: Kind, name: str, obj: JsonObject, old: JsonObject | None) -> None:
        causes = self.validate(kind, obj, old)
        if causes:
            raise invalid(kind, name, causes)

    def _write(
        self, kind: Kind, namespace: str, name: str, obj: JsonObject, type_: str
    ) -> JsonObject:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._objects[_key(kind, namespace, name)] = obj
        self._record(Event(self.rv, kind, type_, obj))
        return obj

    def _record(self, event: Event) -> None:
        self._log.append(event)
        while len(self._log) > self._history:
            self._compacted = self._log.popleft().rv
        self.changed.set(self.rv)


def _with_type(kind: Kind, body: JsonObject) -> JsonObject:
    """A copy of ``body`` with its kind and apiVersion (the decoder's defaults) and metadata."""
    obj = copy.deepcopy(body)
    obj.setdefault("apiVersion", kind.api_version)
    obj.setdefault("kind", kind.kind)
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise bad_request(
            f'{kind.kind} in version "{kind.version}" cannot be handled: metadata must be an object'
        )
    return obj


def _generate_name(prefix: str) -> str:
    prefix = prefix[: _NAME_MAX - _NAME_SUFFIX]
    return prefix + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(_NAME_SUFFIX))

"""What the stand-in API server stores and how a real one treats writes: server-set metadata,
one resourceVersion counter, generateName, optimistic concurrency, preconditions, list pages
and the watch history. No I/O here: :mod:`.server` puts HTTP in front.

Each rule is the real API server's, read in kubernetes/kubernetes (``staging/src/k8s.io/``
``apiserver/pkg/registry/generic/registry/store.go``: Create, Update, Delete, DeleteCollection;
``apiserver/pkg/registry/rest/create.go`` and ``update.go``: BeforeCreate/BeforeUpdate;
``apiserver/pkg/storage/interfaces.go``: Preconditions.Check; ``apiserver/pkg/storage/``
``names/generate.go``: generateName; ``pkg/registry/resource/resourceslice/strategy.go``:
generation). Objects are JSON dicts; a stored dict is never changed in place (an update stores
a new one), so lists and events can share them.
"""

from __future__ import annotations

import base64
import copy
import json
import secrets
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from devplug._kits.values import LatestValue
from devplug.testing.apiserver.field_selectors import FieldSelector, selectable_fields
from devplug.testing.apiserver.status import (
    OPTIMISTIC_LOCK_MESSAGE,
    Cause,
    JsonObject,
    Kind,
    StatusError,
    already_exists,
    bad_request,
    conflict,
    expired,
    invalid,
    not_found,
    precondition_failed,
)

# names.SimpleNameGenerator: 5 characters from utilrand's alphabet (no vowels, no 0/1/3).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_NAME_SUFFIX = 5
_NAME_MAX = 63
_GENERATE_ATTEMPTS = 8  # store.go maxNameGenerationCreateAttempts (RetryGenerateName, GA 1.32)
_CONTINUATIONS_KEPT = 64


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

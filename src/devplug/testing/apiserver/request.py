"""Reading a request as the API server does: which resource and verb the path and method name,
query parameters (booleans, integers), JSON bodies and DeleteOptions; and writing JSON answers
and lists."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devplug.testing.apiserver.http1 import Request, Responder
from devplug.testing.apiserver.status import (
    CLAIMS,
    NODES,
    SLICES,
    JsonObject,
    Kind,
    StatusError,
    bad_request,
)

JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Route:
    kind: Kind
    namespace: str
    name: str  # "" for the collection


def query_bool(values: Sequence[str] | None) -> bool:
    """A boolean query parameter as the API server reads it: false when absent, ``0`` or
    ``false`` (any case); true for anything else, the empty string included."""
    if not values:
        return False
    return not (values[0] == "0" or values[0].lower() == "false")


def route_of(path: str) -> Route | None:
    parts = [part for part in path.split("/") if part]
    if parts[:2] == ["api", "v1"] and len(parts) in (3, 4) and parts[2] == "nodes":
        return Route(NODES, "", parts[3] if len(parts) == 4 else "")
    if parts[:3] != ["apis", "resource.k8s.io", "v1"]:
        return None
    rest = parts[3:]
    if rest[:1] == ["resourceslices"] and len(rest) in (1, 2):
        return Route(SLICES, "", rest[1] if len(rest) == 2 else "")
    if len(rest) in (3, 4) and rest[0] == "namespaces" and rest[2] == "resourceclaims":
        return Route(CLAIMS, rest[1], rest[3] if len(rest) == 4 else "")
    return None


def verb_of(request: Request, route: Route | None) -> str:
    item = route is not None and bool(route.name)
    method = request.method
    if method == "GET":
        if item:
            return "get"
        return "watch" if query_bool(request.query.get("watch")) else "list"
    verbs = {
        ("POST", False): "create",
        ("PUT", True): "update",
        ("PATCH", True): "patch",
        ("DELETE", True): "delete",
        ("DELETE", False): "deletecollection",
    }
    return verbs.get((method, item), method.lower())


def json_body(request: Request, kind: Kind) -> JsonObject:
    content_type = request.headers.get("content-type", JSON).split(";")[0].strip()
    if content_type != JSON:
        raise StatusError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format ({content_type}); "
            "devplug's stand-in takes application/json",
        )
    body = _json_object(request, "the request body")
    api_version, obj_kind = body.get("apiVersion"), body.get("kind")
    if api_version and api_version != kind.api_version:
        raise bad_request(
            f"the API version in the data ({api_version}) does not match the expected API "
            f"version ({kind.api_version})"
        )
    if obj_kind and obj_kind != kind.kind:
        raise bad_request(
            f'{obj_kind} in version "{kind.version}" cannot be handled as a {kind.kind}'
        )
    return body


def delete_options(request: Request) -> JsonObject:
    """DeleteOptions come in the body when there is one, else from the query (apiserver
    ``endpoints/handlers/delete.go``); preconditions only travel in the body."""
    if not request.body:
        return {}
    options = _json_object(request, "DeleteOptions")
    if not isinstance(options.get("preconditions") or {}, dict):
        raise bad_request("DeleteOptions.preconditions must be a JSON object")
    if options.get("dryRun"):
        raise bad_request("dryRun is not supported by devplug's stand-in API server")
    return options


def _json_object(request: Request, what: str) -> JsonObject:
    try:
        body = json.loads(request.body)
    except ValueError as exc:
        raise bad_request(f"{what} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"{what} must be a JSON object")
    return body


def int_param(request: Request, name: str) -> int | None:
    text = request.param(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise bad_request(f'strconv.ParseInt: parsing "{text}": invalid syntax') from None


def watch_timeout(seconds: int | None, limit: float | None) -> float | None:
    if seconds is not None and seconds > 0:
        return float(seconds) if limit is None else min(float(seconds), limit)
    return limit


def untyped(obj: JsonObject) -> JsonObject:
    """An item as lists carry it: without kind and apiVersion."""
    return {key: value for key, value in obj.items() if key not in ("kind", "apiVersion")}


def list_body(kind: Kind, rv: int, items: list[JsonObject]) -> JsonObject:
    return {
        "kind": f"{kind.kind}List",
        "apiVersion": kind.api_version,
        "metadata": {"resourceVersion": str(rv)},
        "items": items,
    }


async def send_json(responder: Responder, code: int, body: Mapping[str, Any]) -> None:
    await responder.send(
        code, json.dumps(body, separators=(",", ":")).encode(), {"Content-Type": JSON}
    )

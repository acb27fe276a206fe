"""What it takes to bring the API server's slices of a pool to the desired ones: a pure function.

:func:`plan_slices` compares the desired slices (from :func:`~devplug.dra.slices.build_pool`)
with the slices the API server holds and returns the pool's generation and the creates,
updates and deletes. Only the content is compared, normalised: server-set metadata
(resourceVersion, uid, timestamps, managedFields), and fields the API server leaves out when
empty (``omitempty``), never make a difference, so an unchanged pool needs no request.

**The generation.** The ``ResourcePool`` contract: "Whenever a driver changes something about
one or more of the resources in a pool, it must change the generation in all ResourceSlices
which are part of that pool", and consumers use only the slices of the highest generation
(kubernetes/api ``resource/v1/types.go``). So the generation goes up by one whenever the
pool's content (devices, slice count) differs from what was published at the highest
generation, and every slice is written at the new one. A hotplug burst is one pass, hence one
bump.

The reference controller (kubernetes/dynamic-resource-allocation ``resourceslice``) keeps the
generation when a single update suffices. devplug does not: the contract asks for the bump;
the pool of most nodes (up to 128 devices) is one slice, where the shortcut would never bump
and the bump costs nothing extra (one PUT either way); and devplug's slices hold the devices
in id order, so a device added or removed in the middle shifts every later slice and the
shortcut would seldom apply to a bigger pool. The price, on a pool of several slices: every
slice is PUT (concurrently), and consumers see the new generation incomplete until the last
one lands (the scheduler then waits rather than allocating from a mix of old and new).

What does not bump: writing slices back with the content they had (after the kubelet wiped
them, or the rest of a pass that broke off half-way: slices of a lower generation are
completed at the highest one), deleting a stray slice of a lower generation, and a new owner
reference. A publisher starting with nothing published gets generation 1; one that finds its
pool as it would publish it (a daemon restart) keeps that pool's generation and writes
nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devplug.dra.apiclient import JsonObject

# Set by the API server (or by clients for their own bookkeeping): never sent back as ours,
# and PUT keeps them from the stored object.
_SERVER_METADATA = ("managedFields",)


def normalised(value: Any) -> Any:
    """``value`` without None, empty objects and empty lists, at any depth: what the API
    server stores and returns for what was sent (Go's ``omitempty``)."""
    if isinstance(value, Mapping):
        kept = {key: normalised(item) for key, item in value.items()}
        return {key: item for key, item in kept.items() if item not in (None, {}, [])}
    if isinstance(value, list | tuple):
        return [normalised(item) for item in value]
    return value


def generation(obj: Mapping[str, Any]) -> int:
    value = obj.get("spec", {}).get("pool", {}).get("generation", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A slice's spec as consumers see it, less the pool generation (a shallow copy: compare
    it with :func:`same`)."""
    spec = dict(obj.get("spec") or {})
    pool = spec.get("pool")
    if isinstance(pool, Mapping):
        spec["pool"] = {key: value for key, value in pool.items() if key != "generation"}
    return spec


def same(a: Any, b: Any) -> bool:
    """Equal as the API server stores them: equal outright (the usual case, and cheap), or
    once both are :func:`normalised`."""
    return bool(a == b) or normalised(a) == normalised(b)


def owner_references(obj: Mapping[str, Any]) -> Any:
    return obj.get("metadata", {}).get("ownerReferences") or []


def at_generation(obj: JsonObject, number: int) -> JsonObject:
    """A copy of the slice ``obj`` at pool generation ``number`` (only the path changes)."""
    spec = obj["spec"]
    return {**obj, "spec": {**spec, "pool": {**spec["pool"], "generation": number}}}


@dataclass(frozen=True, slots=True)
class Published:
    """What a publisher last wrote: the generation and the pool's content (name -> content)."""

    generation: int
    content: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Update:
    body: JsonObject  # what to PUT: the desired slice on the stored one's metadata
    stored: JsonObject


@dataclass(frozen=True, slots=True)
class SlicePlan:
    generation: int
    bumped: bool
    content: Mapping[str, Any]  # the desired pool's content, by slice name
    slices: tuple[JsonObject, ...]  # the desired slices at ``generation``
    creates: tuple[JsonObject, ...] = ()
    updates: tuple[Update, ...] = ()
    deletes: tuple[JsonObject, ...] = ()  # the stored objects (their uid and resourceVersion)

    @property
    def writes(self) -> int:
        return len(self.creates) + len(self.updates) + len(self.deletes)


def plan_slices(
    desired: Sequence[JsonObject],
    stored: Mapping[str, JsonObject],
    last: Published | None = None,
    *,
    hold: Collection[str] = (),
) -> SlicePlan:
    """The generation and the writes that turn ``stored`` (the pool's slices on the API
    server, by name) into ``desired`` (slices of one pool, any generation in them is
    replaced). ``last``: what this publisher wrote before, if anything (after a wipe the API
    server has nothing to compare with). Slices named in ``hold`` are neither written nor
    deleted (they could not be sent)."""
    wanted = {obj["metadata"]["name"]: obj for obj in desired}
    wanted_content = {name: content(obj) for name, obj in wanted.items()}
    top = max([generation(obj) for obj in stored.values()] + [last.generation if last else 0])
    changed = top == 0
    if last is not None and last.generation == top and not same(last.content, wanted_content):
        changed = True
    for name, obj in stored.items():
        if changed:
            break
        if generation(obj) == top and not same(wanted_content.get(name), content(obj)):
            changed = True  # not what was published at ``top`` (someone else's edit, a leftover)
    number = top + 1 if changed else top
    slices = tuple(at_generation(obj, number) for obj in wanted.values())
    creates: list[JsonObject] = []
    updates: list[Update] = []
    for body in slices:
        name = body["metadata"]["name"]
        if name in hold:
            continue
        old = stored.get(name)
        if old is None:
            creates.append(body)
        elif (
            generation(old) != number
            or not same(old.get("spec"), body["spec"])
            or not same(owner_references(old), owner_references(body))
        ):
            updates.append(Update(_on_stored_metadata(body, old), old))
    deletes = tuple(obj for name, obj in stored.items() if name not in wanted and name not in hold)
    return SlicePlan(
        number, changed, wanted_content, slices, tuple(creates), tuple(updates), deletes
    )


def _on_stored_metadata(body: JsonObject, stored: JsonObject) -> JsonObject:
    """The PUT body: the desired spec and owner, on the stored object's metadata (its labels,
    annotations and finalizers are someone else's; its uid and resourceVersion make the PUT
    conditional: 409 when the slice changed since it was read)."""
    meta = {k: v for k, v in stored.get("metadata", {}).items() if k not in _SERVER_METADATA}
    owners = body["metadata"].get("ownerReferences")
    if owners is not None:
        meta["ownerReferences"] = owners
    return {**body, "metadata": meta}

"""Slices checked against the API server's rules before they are sent, so that one odd device
never makes its slice, let alone the pool, fail.

The API server refuses a whole ResourceSlice (422) for one bad device. :func:`screen_slices`
runs the validator (by default :func:`devplug.dra.validate.validate_resource_slice`, the
mirror of the API server's rules) on each slice; the devices its errors point at
(``spec.devices[<i>]...``) leave the slice, which is checked again without them. A slice
still refused for something that is not a device's (its metadata or spec) is not sent at all.
:class:`SliceScreen` does the same and keeps each slice's verdict, so that a pass checks
again only the slices that changed.
:func:`~devplug.dra.slices.build_pool` already leaves out what it knows to be refused (bad
attributes, name collisions); this catches what it does not (a rule of the validator that the
builder does not know, a newer limit).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from devplug.dra.apiclient import JsonObject
from devplug.dra.field_errors import FieldError

SliceValidator = Callable[[Any], list[FieldError]]

_DEVICE_FIELD = re.compile(r"spec\.devices\[(\d+)\]")


@dataclass(frozen=True, slots=True)
class RefusedDevice:
    slice_name: str
    device: str  # the device's name in the pool
    problems: tuple[str, ...]  # "field: message"


@dataclass(frozen=True, slots=True)
class Screened:
    slices: tuple[JsonObject, ...]  # as they may be sent, refused devices taken out
    refused: tuple[RefusedDevice, ...] = ()
    unsendable: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (slice name, problems)


def screen_slices(slices: Sequence[JsonObject], validator: SliceValidator) -> Screened:
    return SliceScreen(validator)(slices)


class SliceScreen:
    """:func:`screen_slices` that remembers each slice's verdict by name and checks again
    only a slice that changed (a hotplug at the end of the pool changes one slice of eight)."""

    def __init__(self, validator: SliceValidator) -> None:
        self._validator = validator
        self._seen: dict[str, tuple[JsonObject, Screened]] = {}

    def __call__(self, slices: Sequence[JsonObject]) -> Screened:
        kept: list[JsonObject] = []
        refused: list[RefusedDevice] = []
        unsendable: list[tuple[str, tuple[str, ...]]] = []
        seen: dict[str, tuple[JsonObject, Screened]] = {}
        for obj in slices:
            name = obj["metadata"]["name"]
            earlier = self._seen.get(name)
            verdict = earlier[1] if earlier is not None and earlier[0] == obj else self._one(obj)
            seen[name] = (obj, verdict)
            kept.extend(verdict.slices)
            refused.extend(verdict.refused)
            unsendable.extend(verdict.unsendable)
        self._seen = seen
        return Screened(tuple(kept), tuple(refused), tuple(unsendable))

    def _one(self, obj: JsonObject) -> Screened:
        name = obj["metadata"]["name"]
        errors = self._validator(obj)
        if not errors:
            return Screened((obj,))
        obj, dropped = without_devices_named(obj, errors)
        refused = tuple(RefusedDevice(name, device, problems) for device, problems in dropped)
        errors = self._validator(obj) if dropped else errors
        unsendable = ((name, tuple(str(error) for error in errors)),) if errors else ()
        return Screened((obj,), refused, unsendable)


def without_devices_named(
    obj: JsonObject, errors: Sequence[FieldError]
) -> tuple[JsonObject, list[tuple[str, tuple[str, ...]]]]:
    """The slice ``obj`` without the devices that ``errors`` point at (``spec.devices[<i>]``
    fields), and those devices' names with their problems ("field: message")."""
    devices: list[Any] = obj["spec"].get("devices") or []
    by_index: dict[int, list[str]] = {}
    for error in errors:
        match = _DEVICE_FIELD.match(error.field)
        if match is not None and int(match[1]) < len(devices):
            by_index.setdefault(int(match[1]), []).append(str(error))
    if not by_index:
        return obj, []
    dropped = [
        (str(_device_name(devices[index], index)), tuple(problems))
        for index, problems in sorted(by_index.items())
    ]
    rest = [device for index, device in enumerate(devices) if index not in by_index]
    spec = {key: value for key, value in obj["spec"].items() if key != "devices"}
    if rest:
        spec["devices"] = rest
    return {**obj, "spec": spec}, dropped


def _device_name(device: Any, index: int) -> str:
    name = device.get("name") if isinstance(device, dict) else None
    return name if isinstance(name, str) else f"devices[{index}]"

"""What the API server refused of this pool (422 Invalid), so that the pool is sent again
without it and stays whole.

A slice the API server refuses is not stored, and a pool with a slice missing is incomplete:
``resourceSliceCount`` says more slices than exist, and the scheduler's allocator then treats
the whole pool as incomplete (allocationMode All fails on it). So a refusal is not the end of
the slice: :meth:`ApiRefusals.learn` keeps what was refused, and :meth:`ApiRefusals.apply`
takes it out of the next pass's slices:

- the devices the Status's causes point at (``spec.devices[<i>]...``) leave their slice, which
  goes again with the others (its rules are stricter than devplug's screen: a newer limit);
- a slice refused for something that names no device (a newer limit on the slice as a whole,
  fields the client cannot send) goes again without devices: an empty slice keeps the count
  right, and its devices are left out, each with the reason;
- an empty slice refused as well cannot be helped by sending: the writer holds that body.

A refusal holds for the content it was made for: a device (or slice) that changes is sent as
it is now, and refused again if it must be. A device that leaves the pool is forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from devplug.dra.apiclient import JsonObject, StatusCause
from devplug.dra.field_errors import FieldError
from devplug.dra.screening import RefusedDevice, Screened, without_devices_named
from devplug.dra.slicediff import content, normalised


@dataclass(frozen=True, slots=True)
class _Refused:
    content: Any  # normalised: a device's JSON, or a slice's content (spec less generation)
    problems: tuple[str, ...]


class ApiRefusals:
    """The devices and slices the API server refused, by name, with what they were then."""

    def __init__(self) -> None:
        self._devices: dict[str, _Refused] = {}
        self._slices: dict[str, _Refused] = {}  # refused whole: sent again without devices

    def __bool__(self) -> bool:
        return bool(self._devices or self._slices)

    def learn(self, body: JsonObject, causes: Sequence[StatusCause], reason: str) -> bool:
        """Keep what the refusal of ``body`` (a slice as sent) says; True when the slice can
        go again without it, False when nothing of it can (an empty slice refused)."""
        errors = [FieldError(cause.field, cause.reason, cause.message) for cause in causes]
        _, named = without_devices_named(body, errors)
        devices = {device["name"]: device for device in body["spec"].get("devices") or ()}
        if named:
            for name, problems in named:
                if name in devices:
                    self._devices[name] = _Refused(normalised(devices[name]), problems)
            return True
        if devices:
            problems = tuple(f"{c.field}: {c.message}" for c in causes) or (reason,)
            self._slices[body["metadata"]["name"]] = _Refused(normalised(content(body)), problems)
            return True
        return False

    def apply(self, screened: Screened) -> Screened:
        """``screened`` without what the API server refused (each such device among the
        refused, with the API server's reason)."""
        if not self:
            return screened
        present: set[str] = set()
        slices: list[JsonObject] = []
        refused: list[RefusedDevice] = list(screened.refused)
        for obj in screened.slices:
            name = obj["metadata"]["name"]
            kept: list[Any] = []
            for device in obj["spec"].get("devices") or ():
                present.add(device["name"])
                known = self._devices.get(device["name"])
                if known is not None and known.content == normalised(device):
                    why = tuple(f"refused by the API server: {p}" for p in known.problems)
                    refused.append(RefusedDevice(name, device["name"], why))
                else:
                    kept.append(device)
            obj = _with_devices(obj, kept)
            whole = self._slices.get(name)
            if kept and whole is not None and whole.content == normalised(content(obj)):
                why = tuple(f"the API server refused its slice: {p}" for p in whole.problems)
                refused.extend(RefusedDevice(name, device["name"], why) for device in kept)
                obj = _with_devices(obj, [])
            slices.append(obj)
        self._devices = {n: r for n, r in self._devices.items() if n in present}
        names = {obj["metadata"]["name"] for obj in slices}
        self._slices = {n: r for n, r in self._slices.items() if n in names}
        return replace(screened, slices=tuple(slices), refused=tuple(refused))


def _with_devices(obj: JsonObject, devices: list[Any]) -> JsonObject:
    """``obj`` with ``devices`` (left out when empty, as the API server stores it)."""
    if devices == (obj["spec"].get("devices") or []):
        return obj
    spec = {key: value for key, value in obj["spec"].items() if key != "devices"}
    if devices:
        spec["devices"] = devices
    return {**obj, "spec": spec}

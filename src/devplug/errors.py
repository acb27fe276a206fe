"""The exception tree: every error devplug raises on purpose derives from DevplugError."""

from __future__ import annotations


class DevplugError(Exception):
    """Base of devplug's own errors."""


class ConfigError(DevplugError):
    """A setting is wrong. ``field`` names it (dotted, e.g. ``scanners.generic[0].match``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class InvalidNameError(DevplugError, ValueError):
    """A resource name, device id or file name breaks a rule; the message cites the rule."""


class AllocationError(DevplugError):
    """An Allocate-family request cannot be answered.

    ``kind`` is ``"not_found"`` (ids that are not advertised), ``"invalid"`` (ids that are
    advertised but unusable, or a malformed request) or ``"exhausted"`` (too many such requests
    at once). Hooks may raise it; the servicer turns it into the matching gRPC status.
    """

    def __init__(self, kind: str, message: str, device_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.device_ids = device_ids


class ScanCancelled(DevplugError):
    """The daemon is stopping: the scan in progress gives up at the next device it reads.

    Raised by the device source; scanners should let it propagate.
    """


class CdiSpecError(DevplugError, ValueError):
    """A CDI spec breaks a rule the CDI library applies when it loads specs (so a runtime would
    reject the file); the message names the field."""

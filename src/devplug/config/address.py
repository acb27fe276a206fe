"""``HOST:PORT`` addresses (``metrics_address``), checked part by part."""

from __future__ import annotations

import ipaddress
import re

_ADDRESS = re.compile(r"(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:\[\]]*)):(?P<port>[0-9]{1,5})")
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6; an empty host means every address).

    The port is 0 to 65535 (0: any free port); the host an IPv4 address, an IPv6 address in
    brackets, or a host name. Raises ValueError saying which part is wrong.
    """
    try:
        return _parse_address(value)
    except ValueError as exc:
        raise ValueError(f"{exc}; want HOST:PORT, e.g. 127.0.0.1:9400 or [::]:9400") from None


def _parse_address(value: str) -> tuple[str, int]:
    match = _ADDRESS.fullmatch(value)
    if match is None:
        raise ValueError(f"got {value!r}")
    port = int(match["port"])
    if port > 65535:
        raise ValueError(f"the port must be 0 to 65535, got {port} in {value!r}")
    if match["v6"] is not None:
        try:
            ipaddress.IPv6Address(match["v6"])
        except ValueError:
            raise ValueError(f"{match['v6']!r} is not an IPv6 address (in {value!r})") from None
        return match["v6"], port
    host = match["host"]
    if not host:
        return "0.0.0.0", port
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address (in {value!r})") from None
        return host, port
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(
            f"{host!r} is not a host name or IP address (in {value!r}; IPv6 goes in brackets)"
        )
    return host, port

"""Process limits the daemon raises at start.

systemd gives a service a soft RLIMIT_NOFILE of 1,024 (and a hard one of 524,288); each idle
client connection, ListAndWatch stream and udev read costs a descriptor, and a scan that runs
out of them cannot read sysfs. The soft limit is raised to the hard one, which needs no
privilege. (``select()``'s 1,024 ceiling does not apply: asyncio and gRPC use epoll.)
"""

from __future__ import annotations

import resource

import structlog

log = structlog.get_logger(__name__)

# A hard limit this high (RLIM_INFINITY included) is clamped: a descriptor table sized for it
# would cost memory for nothing.
MAX_NOFILE = 1 << 20


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most MAX_NOFILE); return (before,
    after). Never raises: a limit that cannot be changed is logged and kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_NOFILE if hard == resource.RLIM_INFINITY else min(hard, MAX_NOFILE)
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft, soft
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("limits.nofile.unchanged", soft=soft, hard=hard, reason=str(exc))
        return soft, soft
    log.info("limits.nofile.raised", before=soft, after=target, hard=hard)
    return soft, target

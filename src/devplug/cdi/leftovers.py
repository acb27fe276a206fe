"""Clearing what earlier runs left in the CDI dir, once at start-up.

A daemon killed or restarted with fewer resources leaves specs nobody serves (a runtime
would still inject their devices), temp files of writes cut half way, and the locks of
daemons gone. Only this instance's files go (:mod:`devplug.cdi.store` has the rules); the
specs of the resources advertised now stay, for the sync's first pass to check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Set

import structlog

from devplug._kits.problems import error_reason
from devplug.cdi.files import remove_temp_files
from devplug.cdi.ownership import state_dir
from devplug.cdi.store import SpecStore

# The sync's logger: the events below were always its own.
log = structlog.get_logger("devplug.cdi")

# Temp files younger than this may be another instance's write in progress.
TEMP_FILE_MIN_AGE_S = 60.0


async def remove_leftovers(
    store: SpecStore, wanted: Set[str], pause: Callable[[], Awaitable[None]]
) -> None:
    """Delete this instance's specs of earlier runs but those named in ``wanted`` (the spec
    files of the resources advertised now), old temp files and the locks of daemons gone.

    Raises OSError when the dir cannot be used (to be tried again). ``pause`` is awaited
    before each spec's removal (the sync's: it ends the clean-up once the daemon stops). Each
    look through a dir is one worker-thread hop, so that thousands of other writers' files
    cost little (their names only: candidates come from devplug's records).
    """
    directory = store.directory
    await store.prepare()
    stale_temps = await remove_temp_files(directory, TEMP_FILE_MIN_AGE_S)
    stale_temps += await remove_temp_files(state_dir(directory), TEMP_FILE_MIN_AGE_S)
    await store.remove_dead_locks()
    candidates = await store.stale_candidates()
    for name in candidates:
        if name in wanted:
            continue
        await pause()
        try:
            resource = await store.remove_stale(name)
        except OSError as exc:
            log.warning("cdi.spec.remove_failed", file=name, reason=error_reason(exc))
            continue
        if resource is not None:
            log.info("cdi.spec.removed", file=name, resource=resource, reason="stale")
    if stale_temps:
        log.info("cdi.temp_files.removed", count=stale_temps)

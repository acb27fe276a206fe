"""The floor for bench.hotplug: a bare pyudev monitor read through ``loop.add_reader``.

Run as a child process by bench.hotplug (under the same testbed): prints ``ready`` once
listening, then one line per event of the subsystems named on its command line (drm when none)
it receives, so the parent can time emit -> delivery to another process, which is the least
any event-driven plugin must spend.
"""

from __future__ import annotations

import asyncio
import sys

import pyudev


async def main() -> None:
    monitor = pyudev.Monitor.from_netlink(pyudev.Context(), "kernel")
    for subsystem in sys.argv[1:] or ["drm"]:
        monitor.filter_by(subsystem)
    monitor.start()
    loop = asyncio.get_running_loop()

    def readable() -> None:
        while (device := monitor.poll(timeout=0)) is not None:
            sys.stdout.write(f"{device.action} {device.sys_path}\n")
        sys.stdout.flush()

    loop.add_reader(monitor.fileno(), readable)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    asyncio.run(main())

"""Small asyncio kits that know nothing of devplug: a latest-value holder, back-off with
jitter, a directory watch (inotify), logging a problem once and a repeated event at a bounded
rate, a stop's time budget, tasks scoped to a block, settings models built without pydantic's
plugin discovery, a package's names loaded on first use, foreign text made safe to print,
a server's unix socket put at its path without clobbering another's, a small file
replaced atomically, the garbage collector settled (long-lived objects kept out of its
automatic passes), a file read that a signal can cut short.

May use: the standard library, structlog and asyncinotify. Nothing of devplug: every room may
use the kits, so the kits use none of them (the import contracts in pyproject.toml).
"""

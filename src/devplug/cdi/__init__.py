"""CDI: spec files that describe each resource's devices to container runtimes.

Grouped by job, lowest first (each module imports only those below it; the ``cdi-layers``
contract in pyproject.toml checks it):

- the spec: ``spec`` (CDI names, the spec model, its validation, the ``cdiVersion`` it needs,
  its JSON) and ``render`` (a resource's devices -> its spec: kinds and device names, each
  device's edits, the file's bytes, reusing what did not change);
- the disk: ``stamps`` (what tells a file devplug wrote from another, with no aiofiles, for
  Allocate's lstat), ``files`` (atomic writes, bounded reads, dir checks), ``ownership`` (the
  ``.devplug`` state dir: records, daemons' locks, the mutex) and ``store`` (who may write or
  remove which spec in a dir shared with others);
- what Allocate asks: ``allocate`` (the catalog of what the specs on disk define, and the CDI
  names in answers);
- the sync that follows the tree: ``passes`` (one pass's plan, its file work, the ledger of
  what passes came to) and ``sync`` (when to pass, start-up clean-up, shutdown);
- ``generate``: ``devplug cdi generate``, the whole tree at once without a daemon.

May use: the scanners' protocols, config, the model, naming, errors, the kits and aiofiles.
Never the other fronts (hotplug, kubelet, dra, ops): the composition wires them.
"""

"""CDI: spec files that describe each resource's devices to container runtimes.

Pure parts (``names``, ``spec``, ``build``) turn a resource's devices into a spec; ``files``,
``ownership`` and ``store`` put specs on disk as their owner in a dir shared with others;
``sync`` keeps them in line with the advertised tree (``ledger`` records what each pass came
to; ``leftovers`` clears what earlier runs left, at start-up); ``catalog`` and ``allocate`` give
Allocate the CDI names of what is on disk; ``generate`` is ``devplug cdi generate``.

May use: the scanners' protocols, config, the model, naming, errors, the kits and aiofiles.
Never the other fronts (hotplug, kubelet, dra, ops): the composition wires them. Inside, a
module imports only those below it in the ``cdi-layers`` contract (pyproject.toml).
"""

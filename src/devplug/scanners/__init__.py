"""Scanners: turn udev devices into a DeviceTree. See ``base`` for the protocols.

The udev source (:mod:`.udev`) gives scanners read-only views of devices; ``generic``,
``intel_gpu`` and ``vfio`` are the built-in scanners, ``registry`` names them for config and
the command line, ``incremental`` helps a scanner rescan only what an event named.

May use: config, the model, the preferred-allocation policy, naming, sizing and errors;
pyudev only in :mod:`.udev`. Never the fronts or the composition: they call the scanners.
"""

"""The hotplug front: keeps the advertised DeviceTree current as devices come and go.

:mod:`.loop` decides when to scan (udev events read by :mod:`.listener`, the resync period,
a rescan request such as SIGHUP, a failed scanner's retry) and hands each result on;
:mod:`.scanning` runs the scanners off the loop and merges their trees within the kubelet's
list limit (:mod:`.list_limit`); :mod:`.health` reports bad news at once and good news once it
has lasted, and applies the operator's cordons (:mod:`.cordons`, kept in a state file;
:mod:`.cordon_requests` answers the control channel's requests about them).

May use: the scanners (uevents come through :mod:`devplug.scanners.udev`, never pyudev
directly), config, the model, naming, sizing, errors and the kits. Never the other fronts
(kubelet, cdi, dra, ops): the composition wires them. Inside: ``cordon_requests`` -> ``loop``
-> ``scanning`` | ``health`` | ``listener`` | ``cordons`` -> ``list_limit`` (the import contracts
in pyproject.toml).
"""

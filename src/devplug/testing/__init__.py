"""Test tools for devplug and for plugin authors.

May use every room, as a test does (it runs the real daemon); grpc and protobuf only in the
kubelet stand-ins (:mod:`.simulator`, its pod resources API :mod:`.podresources`, and
:mod:`.kubelet_dra`). The daemon's own code never imports it: the layers contract puts it at
the top, just below the command line, and only ``scan --replay`` uses it (to build a
:mod:`.umockdev` testbed from a record).

- :class:`KubeletSimulator`: a kubelet stand-in over real unix sockets (Registration with the
  kubelet's checks, dial-back, ListAndWatch recording, Allocate/GetPreferredAllocation/
  PreStartContainer helpers, ``restart()``), and beside it the kubelet's pod resources API
  (:mod:`.podresources`: ``List``, ``GetAllocatableResources`` and ``Get`` over what its own
  ``allocate`` handed out, to a pod and container it may name; feature gates as a kubelet's).
- ``python -m devplug.testing`` (:mod:`.console`): ``kubelet DIR``, that stand-in to try
  ``devplug run`` against from a shell; ``mock-host DIR`` (:mod:`.mockhost`), a preset mock
  host or a recorded one (``--from``) on disk.
- :mod:`devplug.testing.kubelet_dra`: the kubelet's side of DRA (the plugin watcher's
  registration handshake, NodePrepareResources and NodeUnprepareResources calls).
- :func:`running_daemon`, :class:`StaticScanner`, :func:`daemon_settings`: run the real daemon
  inside a test; the :class:`RunningDaemon` it yields says what the daemon has done
  (:class:`DaemonStats`, to await) and takes rescan, reload and stop requests.
  :func:`daemon_process` runs it as ``devplug run`` in a child process instead.
- :func:`eventually`: wait for state that has no event to await (files, counters, logs);
  a wait that runs out quotes what the in-test daemon last logged as a problem
  (:mod:`.daemon_log`).
- :mod:`devplug.testing.kubevirt`: what KubeVirt's virt-launcher makes of an Allocate answer,
  for tests of VFIO-style scanners.
- :mod:`devplug.testing.umockdev`: mock hardware for real pyudev code (``UmockdevHost`` and
  presets such as ``add_usb_serial``, ``add_intel_gpu``); tests using it run under
  ``umockdev-wrapper``.
- :mod:`devplug.testing.apiserver`: a stand-in Kubernetes API server for the DRA front
  (``ApiServer``: ResourceSlice list/watch/create/replace/delete/deletecollection, claims and
  nodes to read, 409/410/422 as a real one answers, request counts, outages) over real HTTP,
  with a kubeconfig to point any client at it.
"""

from devplug.daemon import DaemonStats
from devplug.testing.harness import FAST_TIMING, StaticScanner, daemon_process, daemon_settings
from devplug.testing.running import RunningDaemon, running_daemon
from devplug.testing.simulator import (
    KubeletSimulator,
    ListedDevice,
    PluginOptions,
    PluginSession,
    Registration,
    SimulatorRpcError,
)
from devplug.testing.waiting import eventually

__all__ = [
    "FAST_TIMING",
    "DaemonStats",
    "KubeletSimulator",
    "ListedDevice",
    "PluginOptions",
    "PluginSession",
    "Registration",
    "RunningDaemon",
    "SimulatorRpcError",
    "StaticScanner",
    "daemon_process",
    "daemon_settings",
    "eventually",
    "running_daemon",
]

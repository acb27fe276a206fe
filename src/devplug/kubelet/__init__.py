"""The kubelet front: serves each resource of the DeviceTree to the kubelet over the v1beta1
DevicePlugin gRPC API and stays registered across kubelet restarts; and follows, through the
kubelet's pod resources API, which containers hold the devices it serves.

Serving: :mod:`.servers` keeps one :mod:`.server` per resource (the resources that came, went
or changed from :mod:`.diff`; its start and stop hooks in :mod:`.lifecycle`); a server listens
on its socket, registers (:mod:`.registration`, saying how long it waited for a kubelet through
:mod:`.waiting`) and serves the :mod:`.servicer` through :mod:`.handlers`. The servicer answers
from :mod:`.allocation`, :mod:`.preferring` and the answer cache (:mod:`.answers`,
:mod:`.answer_log`), encoding with :mod:`.wire`; what it needs from CDI and the metrics comes
in through :mod:`.seams`.

Holders: :mod:`.holders` reads the pod resources API (:mod:`.podresources`, which hands back
plain values, for ``devplug status --pods`` too) after each change of the advertised tree and
compares: unhealthy devices in use (a fault, or a cordon's drain), devices gone while
allocated, and the kubelet's allocatable set drifting from what devplug advertises.

May use: grpc and protobuf (``devplug._proto``), the scanners' protocols, the model, the
preferred-allocation policy, naming, errors and the kits. Never the other fronts: the
composition hands in what fits :mod:`.seams`. Inside: ``servers | holders`` -> ``server`` ->
``handlers`` -> ``servicer`` -> ``preferring`` -> the parts (the import contracts); holders
stands beside the servers, and both use the parts below.
"""

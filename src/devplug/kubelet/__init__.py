"""The device plugin front: serves each resource of the DeviceTree to the kubelet over the
v1beta1 DevicePlugin gRPC API, and stays registered across kubelet restarts.

:mod:`.servers` keeps one :mod:`.server` per resource (its start and stop hooks in
:mod:`.lifecycle`); a server listens on its socket, registers (:mod:`.registration`) and serves
the :mod:`.servicer` through :mod:`.handlers`. The servicer answers from :mod:`.allocation`,
:mod:`.preferring` and the answer cache (:mod:`.answers`, :mod:`.answer_log`), encoding with
:mod:`.wire`; what it needs from CDI and the metrics comes in through :mod:`.seams`.

May use: grpc and protobuf (``devplug._proto``), the scanners' protocols, the model, the
preferred-allocation policy, naming, errors and the kits. Never the other fronts: the
composition hands in what fits :mod:`.seams`. Inside: ``servers`` -> ``server`` ->
``handlers`` -> ``servicer`` -> ``preferring`` -> the parts (the import contracts).
"""

"""The DRA front: the advertised DeviceTree as ``resource.k8s.io/v1`` ResourceSlices of one
node-local pool, and the kubelet DRA plugin that prepares claims with the same CDI ids the
device-plugin front hands out.

What this room may use: the model, the settings, the scanners' protocols, the naming rules,
errors and the kits. Never the other
fronts (``kubelet/``, ``cdi/``, ``hotplug/``, ``ops/``): the composition wires them. grpc and
protobuf only in the kubelet-plugin modules (:mod:`.registration`, :mod:`.service`,
:mod:`.sockets`), lightkube and its HTTP stack only in :mod:`.apiclient` (the import contracts
in pyproject.toml); the slice builder, names and validator are pure, and :mod:`.claims` is
free of grpc.

- :mod:`.naming`: device ids -> stable DNS labels; pool, driver and slice names.
- :mod:`.attributes`: what each device says about itself (resource, id, NUMA, PCI, extras).
- :mod:`.slices`: one pool's ResourceSlice objects, as the JSON the API server takes.
- :mod:`.validate`, :mod:`.validate_device`: the API server's semantic rules for a
  ResourceSlice and for one device, as :mod:`.field_errors` (field, reason, message);
  :mod:`.formats` holds the name formats (DNS label, C identifier, ...) they share.
- :mod:`.apiclient`: the REST calls to the API server, as plain JSON, behind one interface.
- :mod:`.publisher`: keeps the pool published (settle, build, write, back off); it follows
  the API server's slices through :mod:`.slicemirror` (list, then watch), checks each slice
  in :mod:`.screening`, plans the generation and the writes in :mod:`.slicediff` and sends
  them through :mod:`.slicewrites`, which sends a slice the API server refused again without
  what it refused (:mod:`.refusals`).
- :mod:`.registration`: the kubelet plugin's registration socket and DRA service socket;
  :mod:`.sockets` claims a socket path without clobbering anyone's.
- :mod:`.service`: the DRAPlugin service (v1 and v1beta1) over :mod:`.claims`, which decides
  Prepare and Unprepare and keeps their answers in :mod:`.checkpoint`.
- :mod:`.front`: the front as the daemon runs it: the publisher, the kubelet plugin and the
  claims over one API client, following the advertised tree; the node and API server from the
  environment, and which ``dra.resources`` a configured scanner makes.
"""

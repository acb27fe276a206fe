"""The DRA front: the advertised DeviceTree as ``resource.k8s.io/v1`` ResourceSlices of one
node-local pool, and (next) the kubelet DRA plugin that prepares claims with the same CDI ids
the device-plugin front hands out.

What this room may use: the model, the naming rules, errors and config. Never the other
fronts (``kubelet/``, ``cdi/``): the composition wires them. grpc and protobuf only in this
room's own kubelet-plugin modules; the slice builder, names and validator are pure.

- :mod:`.naming`: device ids -> stable DNS labels; pool, driver and slice names.
- :mod:`.attributes`: what each device says about itself (resource, id, NUMA, PCI, extras).
- :mod:`.slices`: one pool's ResourceSlice objects, as the JSON the API server takes.
- :mod:`.validate`, :mod:`.validate_device`: the API server's semantic rules for a
  ResourceSlice and for one device, as :mod:`.field_errors` (field, reason, message);
  :mod:`.formats` holds the name formats (DNS label, C identifier, ...) they share.
"""

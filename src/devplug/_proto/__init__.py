"""Generated protobuf and gRPC stubs: see scripts/gen_proto.py."""

"""Benchmarks: ``umockdev-wrapper .venv/bin/python -m bench.<name>``; each prints its figures
next to a floor measured in the same run."""

import os

# grpc-core prints an informational line for every GOAWAY a simulated kubelet's channel gets
# when a plugin server stops; keep the figures readable (set before any bench imports grpc).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

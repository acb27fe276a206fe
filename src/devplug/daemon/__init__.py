"""The running daemon: scanning, diffing, serving and staying registered with the kubelet."""

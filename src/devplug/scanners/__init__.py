"""Scanners: turn udev devices into a DeviceTree. See ``base`` for the protocols."""

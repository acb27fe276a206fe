"""hotplug"""

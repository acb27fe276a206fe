"""CDI spec model, validation and writer: not implemented yet (the CDI issue builds it).

Devices already carry what the writer will need (nodes, mounts, env, ``CdiEdits``).
"""

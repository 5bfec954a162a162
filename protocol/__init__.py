"""redraft.protocol: what the HTTP process and the engine process agree on. Torch-free, imports no other part
of redraft, so that server/, scheduler/ and engine/ can all depend on it without depending on each other.

- `sampling_params`: per-request parameters, the mode presets, and `resolve`, the one chain of defaults
- `messages`: the typed messages sent over ZMQ between the two processes
- `server_args`: `ServerArgs`, every operator setting with its default, written once
- `errors`: `RequestError`, one request refused or failed, as its client reads it
- `processes`: the signal policy every child process of redraft follows (the engine, its ranks, helper pools)
"""

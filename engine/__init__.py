"""redraft.engine, in four rooms (docs/architecture.md): text (the front: what the HTTP process loads), model, decoding, runtime (the engine process)."""

"""The engine process: a trio scheduler over the model, speaking a protocol on stdin/stdout.

- ``engine_process``: ``coli engine``: the nursery, the stdin reader (mux), the stdout writer,
  the SIGTERM drain; ``legacy_session``: the legacy protocol's single conversation.
- ``engine``: the slot table, each request's lifecycle, the step loop, cancellation.
- ``requests``: Slot and Request, the state the lifecycle moves.
- ``planner``: the rows of the next step (continuous batching, chunked prefill); pure.
- ``telemetry``: HWINFO, the expert maps, a finished turn's PERF and DONE.
- ``persist``: crash-safe slot and usage files.

The model is an ``EngineModel`` (``colibri.model.interface``): nothing here imports the network,
the kernels or the store.
"""

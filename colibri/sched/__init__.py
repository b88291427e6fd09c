"""The engine process: a trio scheduler over the model, speaking a protocol on stdin/stdout.

- ``core``: slots, requests, the step loop (continuous batching, chunked prefill), cancellation.
- ``mux_server``, ``legacy_server``: bind a codec from ``colibri.io`` to stdin/stdout and the core.
- ``persist``: crash-safe slot and usage files.
- ``telemetry``: host facts for HWINFO and STAT.
"""

"""Sans-IO codecs for the engine's wire protocols: bytes in, events out; events in, bytes out.

No I/O, no threads, no trio: ``colibri.sched`` binds them to pipes, ``colibri.api`` to a child
process, the fuzzers in ``fuzz/`` to random bytes.

- ``events``: the mux protocol's requests, responses and telemetry as dataclasses.
- ``buffer``: the shared receive buffer (lines, byte-counted payloads, resynchronisation).
- ``mux``: the mux protocol, both directions.
- ``legacy``: the single-slot interactive protocol behind ``coli chat``.
"""

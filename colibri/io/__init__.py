"""Sans-IO codecs for the engine's wire protocols: bytes in, events out; events in, bytes out.

No I/O, no threads, no trio: ``colibri.sched`` binds them to pipes, ``colibri.api`` to a child
process, the fuzzers in ``fuzz/`` to random bytes.

- ``events``: the mux protocol's requests, responses and telemetry as dataclasses.
- ``buffer``: the receive buffer: lines and exact byte counts taken off the front, in linear time.
- ``framing``: the framing both protocols share (a header line announcing N bytes, the payload, a
  newline; line limits; resynchronisation after a lying count), as ``Line``/``Payload``/
  ``Unframed``/``Overlong`` items. The one place that decides where a frame starts.
- ``mux``: the mux protocol, both directions: what its lines and payloads mean.
- ``legacy``: the single-slot interactive protocol behind ``coli chat``, both directions.
- ``channel_frames``: the Channel binary protocol's opcodes, codes and messages as dataclasses.
- ``channel``: the Channel protocol's codec: the 16-byte envelope and every payload, both
  directions (the engine reads requests with it, a host or ``coli channel`` reads replies); it
  shares nothing with the line protocols' framing.
"""

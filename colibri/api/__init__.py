"""The OpenAI-compatible HTTP server in front of the engine (``coli serve``).

Imports only ``colibri.io`` (the engine's protocol), ``colibri.model.text`` (template and
vocabulary, no weights), ``colibri.errors`` and ``colibri.settings``; never the engine or the store.

- ``http_server``: ``run_server`` (the entry point): hypercorn, the engine child, systemd, the drain.
- ``app``: the quart-trio app: limits, the guards every request passes, error handlers.
- ``routes``: the HTTP handlers, a Blueprint; ``server_state``: what they share.
- ``completion``: one completion request from admission to the last byte (JSON or SSE).
- ``generation``: one generation without HTTP: engine events -> text, logprobs, usage, stats.
- ``openai_requests``, ``openai_responses``, ``openai_errors``: OpenAI's request validation,
  answer shapes and SSE framing, and error bodies.
- ``admission``: KV slots and the bounded queue; ``engine_client``: the mux protocol over a child.
- ``stop``, ``metrics``, ``security``, ``static``, ``sdnotify``: stop strings, Prometheus,
  guards (key, Host, CORS), the web page, systemd's notify protocol.
"""

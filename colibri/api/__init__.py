"""The OpenAI-compatible HTTP server in front of the engine (``coli serve``).

Imports only ``colibri.io`` (the engine's protocol), ``colibri.model``'s text side (template and
vocabulary, the tool-call format, grammar checks; no weights), ``colibri.errors`` and
``colibri.settings``; never the engine or the store.

- ``http_server``: ``run_server`` (the entry point): hypercorn, the engine child, systemd, the drain.
- ``app``: the quart-trio app: limits, the guards every request passes, error handlers.
- ``routes``: the HTTP handlers, a Blueprint; ``server_state``: what they share.
- ``serving``: the one path of every generation endpoint, from admission to the last byte.
- ``generation``: one generation without HTTP: engine events -> text, logprobs, usage, stats.
- ``openai_requests``, ``responses_api``, ``openai_errors``: OpenAI's request validation (chat and
  completions; the Responses API over it) and error bodies; ``json_body``: client JSON within
  limits (the body and tool-call arguments).
- ``shaping``, ``completion_shapes``, ``responses_shapes``: the answer in each endpoint's shapes,
  JSON or SSE; ``tools``, ``structured``: tool calls and structured outputs as grammars.
- ``admission``: KV slots and the bounded queue; ``slot_owners``: whose conversation a slot holds
  (only its owner reuses it); ``engine_client``: the mux protocol over a child.
- ``stop``, ``metrics``, ``security``, ``static``, ``sdnotify``: stop strings, Prometheus,
  guards (key, Host, CORS), the web page, systemd's notify protocol.
"""

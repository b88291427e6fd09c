"""Fuzz the request body validator of every POST route: bytes -> ``parse_json`` -> ``parse_chat``
(the default model's real chat template, ``ModelText.render``), ``parse_completion`` and the
Responses API's ``responses_api.parse``.

``check(data)`` asserts, for each route, that the body becomes either

- a ``Generation`` the engine can take: prompt, messages and stop strings encodable as UTF-8, every
  number in its documented range (api.md), a grammar within the engine's limit (``io/mux.py``);
  for Responses, the request fields its response repeats encodable as UTF-8 (a stream writes
  them after its headers); or
- an ``ApiError`` with a 4xx status whose OpenAI-shaped body serialises as JSON;

and never raises anything else (a 500 in the server, or a stream cut after its first chunk).

Run: ``python fuzz/fuzz_http_body.py fuzz/out/http fuzz/corpus/http -dict=fuzz/http.dict`` (needs
atheris); ``check`` alone needs only colibri, for replaying the corpus (tests/test_fuzz_corpus.py).
``make_http_corpus.py`` writes the seeds.
"""

from __future__ import annotations

import json
import math
import sys

from colibri import settings
from colibri.api import responses_api
from colibri.api.json_body import parse_json
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import (
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    Generation,
    parse_chat,
    parse_completion,
)
from colibri.api.stop import MAX_STOP_CHARS, MAX_STOPS
from colibri.api.structured import grammar_bytes
from colibri.io.mux import MAX_GRAMMAR
from colibri.model.text import ModelText

TEXT = ModelText.open(settings.default_model_path())
N_CTX = min(settings.CTX.default, TEXT.context_length or settings.CTX.default)  # as coli serve caps it
N_SLOTS = settings.SERVE_SLOTS.default


def check_error(e: ApiError) -> None:
    assert 400 <= e.status < 500, (e.status, e.message)
    body = json.loads(e.json_bytes())
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(e.message, str) and e.message, e


def utf8(text: str) -> None:
    assert isinstance(text, str), text
    text.encode("utf-8")  # a lone surrogate raises: the engine could not be sent it


def check_generation(g: Generation, kind: str) -> None:
    assert g.kind == kind, g
    utf8(g.prompt)
    for m in g.messages:
        assert m["role"] in ("system", "user", "assistant"), m
        utf8(m["content"])
    assert len(g.stops) <= MAX_STOPS, g.stops
    for s in g.stops:
        utf8(s)
        assert 0 < len(s) <= MAX_STOP_CHARS, s
    assert 1 <= g.max_tokens <= N_CTX, g.max_tokens
    assert math.isfinite(g.temperature) and 0 <= g.temperature <= MAX_TEMPERATURE, g.temperature
    assert math.isfinite(g.top_p) and 0 < g.top_p <= 1, g.top_p
    assert g.seed is None or 0 <= g.seed <= MAX_SEED, g.seed
    assert g.cache_slot is None or 0 <= g.cache_slot < N_SLOTS, g.cache_slot
    assert 0 <= g.top_logprobs <= MAX_TOP_LOGPROBS, g.top_logprobs
    assert isinstance(g.stream, bool) and isinstance(g.include_usage, bool), g
    assert isinstance(g.logprobs, bool), g
    if g.grammar is not None:
        utf8(g.grammar)
        assert grammar_bytes(g.grammar) <= MAX_GRAMMAR, grammar_bytes(g.grammar)


def check(data: bytes) -> None:
    try:
        body = parse_json(data)
    except ApiError as e:
        check_error(e)
        return
    try:
        check_generation(parse_chat(body, TEXT.render, N_CTX, N_SLOTS), "chat")
    except ApiError as e:
        check_error(e)
    try:
        check_generation(parse_completion(body, N_CTX, N_SLOTS), "completion")
    except ApiError as e:
        check_error(e)
    try:
        request = responses_api.parse(body, TEXT.render, N_CTX, N_SLOTS)
    except ApiError as e:
        check_error(e)
    else:
        check_generation(request.gen, "chat")
        utf8(json.dumps(request.echo, ensure_ascii=False))


if __name__ == "__main__":
    import atheris

    atheris.instrument_all()  # colibri and the template engine are imported already
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()

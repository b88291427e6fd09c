"""Speculative decoding through a real ``coli serve`` (the engine's default, prompt lookup): the
answer's ``colibri.perf`` and ``/metrics`` say what was drafted and accepted; a request's
``colibri: {"speculative": false}`` turns it off and gets the same tokens; a bad ``colibri``
object is OpenAI's 400; ``--speculative off`` reaches the engine; ``mtp`` on a model without an MTP
layer fails at start."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from serve_harness import error_body, running_server, serve_command, server_env, user

COPY = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, "
        "lemon, mango, nectarine.")


@pytest.fixture(scope="module")
def server():
    with running_server("--ctx", "1024") as srv:
        yield srv


def _ask(client, **extra):
    r = client.chat.completions.create(model="m", messages=user(COPY), max_tokens=48, temperature=0,
                                       extra_body=extra or None)
    return r.choices[0].message.content, r.model_extra["colibri"]["perf"]


def _metric(http, name: str) -> float:
    text = http.get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])


def test_drafts_are_reported_and_a_request_may_turn_them_off(server):
    client, http = server.client(), server.http()
    before = _metric(http, "colibri_accepted_tokens_total")
    text, perf = _ask(client)
    assert 0 < perf["accepted_tokens"] <= perf["drafted_tokens"], perf
    assert _metric(http, "colibri_accepted_tokens_total") == before + perf["accepted_tokens"]
    plain, perf_off = _ask(client, colibri={"speculative": False})
    assert perf_off["drafted_tokens"] == 0 and plain == text
    again, _ = _ask(client, colibri={"speculative": True})  # the engine's setting
    assert again == text


def test_responses_take_the_same_switch(server):
    r = server.http().post("/v1/responses", json={"model": "m", "input": COPY, "max_output_tokens": 32,
                                                   "temperature": 0, "colibri": {"speculative": False}})
    assert r.status_code == 200, r.text
    assert r.json()["colibri"]["perf"]["drafted_tokens"] == 0


@pytest.mark.parametrize("value", [True, "off", {"speculative": "no"}, {"speculative": False, "x": 1}])
def test_a_bad_colibri_object_is_a_400(server, value):
    r = server.http().post("/v1/chat/completions", json={"model": "m", "messages": user("hi"),
                                                         "colibri": value})
    assert r.status_code == 400
    assert error_body(r)["param"] == "colibri"


def test_the_servers_setting_reaches_the_engine():
    with running_server("--ctx", "1024", "--speculative", "off") as srv:
        _, perf = _ask(srv.client())
        assert perf["drafted_tokens"] == 0


def test_mtp_without_an_mtp_layer_fails_at_start():
    out = subprocess.run([sys.executable, "-m", "colibri", "engine", "--no-persist", "--speculative", "mtp"],
                         input=b"", capture_output=True, env=server_env(), timeout=300, check=False)
    assert out.returncode != 0
    assert b"MTP" in out.stderr and b"Traceback" not in out.stderr
    bad = subprocess.run(serve_command("--speculative", "sometimes"), capture_output=True, env=server_env(),
                         timeout=120, check=False)
    assert bad.returncode != 0 and b"--speculative" in bad.stderr and b"Traceback" not in bad.stderr

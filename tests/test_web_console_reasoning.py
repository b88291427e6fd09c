"""The web console and a thinking model's reasoning, in a real browser (the page itself:
tests/test_web_console.py, whose fixtures and helpers this module shares).

Shown: the reasoning (``reasoning_content`` deltas) is folded in a closed ``<details>`` above the
answer, as plain text; the next turn's history holds the answer alone. Once with the default
server's real stream whose text is swapped for a reasoning and an answer (``page.route``: the page
is a client of the API, whose split is tests/test_serve_reasoning.py's), once with a real thinking
template (the R1-style copy of the default model: its reply starts inside the block, and cut at
max tokens it is all reasoning)."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect
from serve_harness import running_server
from test_serve_reasoning import R1_STYLE, thinking_copy
from test_web_console import (  # noqa: F401 (fixtures)
    browser,
    configure,
    console,
    last_reply,
    load,
    page,
    send,
    wait_reply_done,
)
from web_harness import missing_browser, sse_frames

MISSING = missing_browser()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

SERVER_ARGS = ("--ctx", "2048")  # test_web_console's server (the page served from its default place)
REASONING = ["The user greets me.", "\n<b>I</b> should greet back."]
ANSWER = ["Hello", " there!"]


def with_reasoning(frames: list[str]) -> bytes:
    """A real chat stream's frames with its text replaced: reasoning deltas, then content deltas."""
    chunks = [json.loads(f) for f in frames if f != "[DONE]"]
    kept = [c for c in chunks if not any(ch.get("delta", {}).get("content") for ch in c.get("choices", []))]
    made = []
    for key, pieces in (("reasoning_content", REASONING), ("content", ANSWER)):
        for piece in pieces:
            c = json.loads(json.dumps(chunks[0]))
            c["choices"][0].update(delta={key: piece}, finish_reason=None)
            made.append(c)
    out = kept[:1] + made + kept[1:]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in out) + b"data: [DONE]\n\n"


def test_reasoning_is_folded_above_the_answer_and_not_sent_back(page, console):  # noqa: F811
    pg, _seen = page
    bodies: list[dict] = []

    def thinking(route):
        bodies.append(json.loads(route.request.post_data or "{}"))
        real = route.fetch()
        if real.status != 200:
            return route.fulfill(response=real)
        route.fulfill(status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
                      body=with_reasoning(sse_frames(real.body())))

    pg.route("**/v1/chat/completions", thinking)
    load(pg, console)
    configure(pg, max_tokens=4)
    send(pg, "Hi")
    wait_reply_done(pg)
    reply = last_reply(pg)
    details = reply.locator("details.reasoning")
    expect(details).to_have_count(1)
    assert details.evaluate("d => d.open") is False  # folded
    assert details.locator(".reasoning-text").text_content() == "".join(REASONING)  # text, not markup
    assert details.locator("b").count() == 0
    expect(details.locator("summary")).to_have_text("Reasoning")
    assert reply.locator(".body").text_content() == "".join(ANSWER)
    # above the answer
    assert reply.evaluate("m => m.querySelector('details.reasoning').nextElementSibling.className") == "body"
    details.locator("summary").click()
    expect(details.locator(".reasoning-text")).to_be_visible()
    send(pg, "Again")
    wait_reply_done(pg)
    assert bodies[1]["messages"][-2] == {"role": "assistant", "content": "".join(ANSWER)}


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory, model_path):
    gguf = thinking_copy(model_path, R1_STYLE, tmp_path_factory.mktemp("web-r1") / "smollm2-r1.gguf")
    with running_server("--model", str(gguf), "--ctx", "1024") as srv:
        yield srv


def test_a_real_thinking_templates_reply_shows_folded(page, r1_server):  # noqa: F811
    """The R1-style template opens the block in the prompt: the real model's reply, cut at 6 tokens,
    is reasoning only, shown folded, with an empty answer and the turn's stats."""
    pg, _seen = page
    load(pg, r1_server)
    configure(pg, max_tokens=6, temperature="0")
    send(pg, "Hi")
    assert wait_reply_done(pg) != ""  # the stats line's turn ended; the text is the reasoning's
    reply = last_reply(pg)
    details = reply.locator("details.reasoning")
    expect(details).to_have_count(1)
    assert details.evaluate("d => d.open") is False
    assert details.locator(".reasoning-text").text_content().strip()
    assert reply.locator(".body").text_content() == ""
    expect(reply.locator(".stats")).to_contain_text("cut at max tokens")

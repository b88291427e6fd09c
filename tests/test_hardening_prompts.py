"""A huge prompt costs its sender a 400, not every client a stall (issue 38, item 5).

A prompt that cannot fit the context by its length alone (no token stands for more than the
vocabulary's longest token's bytes) is refused before it is tokenized; one that is tokenized is
tokenized with the GIL let go, so the server's event loop keeps serving meanwhile. Checked on the
real model's tokenizer and on the real server: three 3.8 MB prompts cost it neither seconds of a
core each nor hundreds of MB of memory (before: 4 s and +330 MB).
"""

from __future__ import annotations

import threading

import httpx
import pytest
from serve_harness import running_server

from colibri.model.text import ModelText
from colibri.model.tokenizer import TooManyTokens

BIG = "The quick brown fox jumps over the lazy dog. " * 85000  # 3.8 MB, ~850k tokens
# What the server may grow by over three refused BIG prompts: the bodies' parsing (a few times their
# size, handed back after each) and allocator slack; tokenizing one took ~110 MB for good.
RSS_GROWTH_BOUND_MB = 100


@pytest.fixture(scope="module")
def text(model_path) -> ModelText:
    return ModelText.open(model_path)


def test_a_prompt_too_long_by_its_length_is_refused_untokenized(text):
    tok = text.tokenizer
    with pytest.raises(TooManyTokens) as e:
        text.encode_chat([{"role": "user", "content": BIG}], limit=2048)
    assert e.value.limit == 2048 and e.value.at_least >= tok.least_tokens(len(BIG)) > 2048
    # the bound is a bound: the real count is at least that
    sample = BIG[:20000]
    assert len(tok.encode(sample)) >= tok.least_tokens(len(sample))
    # and a prompt that fits is tokenized as without the limit
    messages = [{"role": "user", "content": "Hello there"}]
    assert text.encode_chat(messages, limit=2048) == text.encode_chat(messages)


def test_tokenizing_lets_other_threads_run(text):
    """The event loop's thread keeps running while a worker thread tokenizes megabytes."""
    ticks = 0
    done = threading.Event()

    def work() -> None:
        text.encode_text(BIG)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    while not done.wait(0.001):  # a loop that needs the GIL between its waits
        ticks += 1
    worker.join()
    assert ticks >= 50, f"only {ticks} turns of the other thread while tokenizing"


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_the_server_refuses_huge_prompts_without_paying_for_them():
    with running_server("--ctx", "2048") as srv:
        before = _rss_mb(srv.pid)
        for _ in range(3):
            r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120,
                           json={"model": "m", "messages": [{"role": "user", "content": BIG}]})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert "resulted in at least" in error["message"]
        grown = _rss_mb(srv.pid) - before
        assert grown < RSS_GROWTH_BOUND_MB, f"the server grew {grown} MB"
        ok = srv.client().chat.completions.create(model="m", max_tokens=2,
                                                  messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content is not None

"""The web console with ``coli serve --api-key`` in a real browser (the page itself:
tests/test_web_console.py, whose fixtures and helpers this module shares): the page asks for the
key once, a wrong key is said to be wrong, the right one sends the waiting turn and is kept in this
tab's sessionStorage only; a late 401 to an older request leaves the accepted key alone. (The
console module's fixtures ``browser`` and ``page`` are imported so that pytest finds them here.)"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect
from serve_harness import running_server
from test_web_console import browser, configure, load, page, send, wait_reply_done  # noqa: F401 (fixtures)
from web_harness import missing_browser

MISSING = missing_browser()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def keyed_server():
    """``coli serve --api-key s3cret``."""
    with running_server("--ctx", "1024", "--api-key", "s3cret") as srv:
        yield srv


def test_a_server_with_a_key_asks_once_and_says_when_it_is_wrong(page, keyed_server):  # noqa: F811
    """``--api-key``: the first turn gets 401 and the page asks for the key (``#key-form``); a wrong
    key is a clear message in ``#key-error``, not a silent failure; the right one sends the turn,
    and is kept in this tab's sessionStorage only."""
    page, _seen = page
    load(page, keyed_server)
    configure(page, 4, "0")
    send(page, "Hello")
    form = page.locator("#key-form")
    expect(form).to_be_visible()
    page.locator("#api-key").fill("wrong")
    page.locator("#api-key").press("Enter")
    expect(page.locator("#key-error")).to_be_visible()
    expect(page.locator("#key-error")).not_to_be_empty()
    page.locator("#api-key").fill("s3cret")
    page.locator("#api-key").press("Enter")
    assert wait_reply_done(page)
    stored = page.evaluate("() => Object.values(sessionStorage)")
    assert "s3cret" in stored and page.evaluate("() => Object.values(localStorage)").count("s3cret") == 0


# Holds back the answers to /v1/models requests sent without a key until the test releases them:
# the page's first poll asks for the model before it knows a key is needed.
HOLD_KEYLESS_MODELS = """(() => {
  const real = window.fetch.bind(window);
  const held = [];
  window.__heldKeyless = () => held.length;
  window.__releaseKeyless = async () => {
    const n = held.length;
    held.splice(0).forEach((go) => go());
    await new Promise((r) => setTimeout(r, 100)); // the callers' continuations run first
    return n;
  };
  window.fetch = (input, init = {}) => {
    const url = String(input instanceof Request ? input.url : input);
    const answer = real(input, init);
    if (!url.endsWith("/v1/models") || new Headers(init.headers || {}).has("Authorization")) return answer;
    return new Promise((resolve) => held.push(() => resolve(answer)));
  };
})();"""


def test_a_late_401_to_an_older_request_does_not_undo_the_accepted_key(page, keyed_server):  # noqa: F811
    """A keyless request still in flight when the user enters the right key answers 401 after the
    key was accepted: that answer is about no key, not this one. The key stays, the form stays
    closed, no error shows, and the next turn goes out without asking (a CI run lost its turn to
    this race)."""
    page, _seen = page
    page.add_init_script(HOLD_KEYLESS_MODELS)
    load(page, keyed_server)
    page.wait_for_function("() => window.__heldKeyless() > 0")
    configure(page, 4, "0")
    send(page, "Hello")
    expect(page.locator("#key-form")).to_be_visible()
    page.locator("#api-key").fill("s3cret")
    page.locator("#api-key").press("Enter")
    assert wait_reply_done(page)
    assert page.evaluate("() => window.__releaseKeyless()") >= 1
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#key-error")).to_be_hidden()
    assert "s3cret" in page.evaluate("() => Object.values(sessionStorage)")
    send(page, "Hi")
    expect(page.locator("#messages .msg.assistant")).to_have_count(2)
    assert wait_reply_done(page)
    expect(page.locator("#key-form")).to_be_hidden()

"""The web console (``colibri/api/web``, served by ``coli serve`` at ``/``) in a real browser.

Playwright drives Debian's headless Chromium (tests/web_harness.py) against two real servers: the
dense default model (the module's ``server``, with the page: no ``--web-dist`` here) and a tiny
Mixtral converted from tests/data/tiny_hf with ``coli convert``, for the expert map.

Shown: Enter sends and the answer streams in with its stats, Shift+Enter is a newline; Stop and
Escape end a long generation and the server's slot is free again (/health); the runtime panel names
the model; the expert map draws and changes after a turn (MoE), the dense model says it has none;
hostile model output (a faked SSE answer) stays text; the page talks only to its own server; no
horizontal overflow on a 390 px phone; the Atlas view; screenshots into docs/screenshots/ (or
COLI_SCREENSHOT_DIR); the SSE reader module alone. A server with an API key:
tests/test_web_console_key.py.

Skipped, all of it, only when /usr/bin/chromium is missing (the reason the Makefile's set-up step
gave is printed).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from serve_harness import LONG_Q, running_server
from web_harness import (
    CANVAS_PIXELS,
    DESKTOP,
    PHONE,
    SCREENSHOTS,
    canvas_pixels,
    launch,
    missing_browser,
    open_context,
    open_settings,
    set_control,
    sse_frames,
    wait_canvas_still,
    wait_health,
    with_content,
)

MISSING = missing_browser()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
if MISSING:  # in the summary of a plain `pytest -q` too, which lists no skip reasons
    warnings.warn(f"tests/test_web_console.py skipped: {MISSING}", stacklevel=1)

# The module's shared server (conftest's ``server``): the page served from its default place, so
# unlike the other end-to-end files no ``--web-dist``.
SERVER_ARGS = ("--ctx", "2048")
TINY_MIXTRAL = Path(__file__).parent / "data" / "tiny_hf" / "mixtral"
REPLY_TIMEOUT_MS = 90_000  # a reply's end: a cold machine, a busy CI
UI_TIMEOUT_MS = 15_000  # the page reacting: a poll of /experts or /health, a render
HEALTH_TIMEOUT_S = 30.0
XSS_PIECES = ['<script>window.__pwned=1</script>', ' <img src=x onerror="window.__pwned=2">']
LONG_WORD = "Pneumonoultramicroscopicsilicovolcanoconiosis" * 8 + "/" + "x" * 120

# An assistant message's text without its stats line.
REPLY_TEXT = """(m) => {
    const c = m.cloneNode(true);
    c.querySelectorAll('.stats').forEach(s => s.remove());
    return c.textContent.trim();
}"""
# From now on, what the last assistant message showed at each change: [text length, has stats].
WATCH_REPLY = """() => {
    window.__seen = [];
    const root = document.querySelector('#messages');
    new MutationObserver(() => {
        const all = root.querySelectorAll('.msg.assistant');
        const m = all[all.length - 1];
        if (!m) return;
        const c = m.cloneNode(true);
        c.querySelectorAll('.stats').forEach(s => s.remove());
        window.__seen.push([c.textContent.trim().length, !!m.querySelector('.stats')]);
    }).observe(root, {childList: true, subtree: true, characterData: true});
}"""


# What a 390 px phone would not show: the elements whose box ends past the viewport's right edge,
# and the boxes that scroll or clip sideways (body's overflow-x: hidden would cut a message off, a
# message list that scrolls sideways hides it). Code blocks may scroll sideways; an ellipsis is meant.
OVERFLOWING = """(width) => {
    const name = (e) => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
        + '.' + (e.getAttribute('class') || '');
    const all = [document.body, ...document.body.querySelectorAll('*')].filter(e => !e.closest('pre'));
    const past = all.filter(e => {
        const r = e.getBoundingClientRect();
        return r.width > 0 && r.right > width + 0.5;
    });
    const sideways = all.filter(e => {
        const s = getComputedStyle(e);
        const clips = s.overflowX !== 'visible' && s.textOverflow !== 'ellipsis';
        return clips && e.scrollWidth > e.clientWidth + 1;
    });
    return [...past.map(e => 'past the edge: ' + name(e)), ...sideways.map(e => 'sideways: ' + name(e))];
}"""

# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = launch(pw)
        yield b
        b.close()


def _console_served(srv) -> None:
    body = httpx.get(srv.base_url + "/", timeout=10).text
    assert 'id="prompt"' in body or "id=prompt" in body, (
        f"GET / on `coli serve` (no --web-dist) is not the web console:\n{body[:400]}")


@pytest.fixture(scope="module")
def console(server):
    """The dense server, once it is known to serve the console at /."""
    _console_served(server)
    return server


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny Mixtral, converted with ``coli convert`` as a user would."""
    out = tmp_path_factory.mktemp("web-moe") / "tiny-mixtral-q8_0.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "colibri", "convert", str(TINY_MIXTRAL), "-o", str(out), "--type", "q8_0"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


def moe_args(tiny_gguf: Path) -> tuple[str, ...]:
    """``coli serve``'s arguments for the tiny Mixtral: every expert resident, a short context."""
    return ("--model", str(tiny_gguf), "--ram-budget", "inf", "--ctx", "256")


@pytest.fixture(scope="module")
def moe_server(tiny_gguf):
    """``coli serve`` on the tiny Mixtral."""
    with running_server(*moe_args(tiny_gguf)) as srv:
        _console_served(srv)
        yield srv


def _page(browser, viewport):
    context, page, seen = open_context(browser, viewport)
    page.set_default_timeout(UI_TIMEOUT_MS)
    yield page, seen
    context.close()
    assert seen.page_errors == [], f"uncaught errors in the page: {seen.page_errors}"


@pytest.fixture
def page(browser):
    """A fresh desktop-sized page; after the test, no uncaught error may have happened in it."""
    yield from _page(browser, DESKTOP)


@pytest.fixture
def phone(browser):
    yield from _page(browser, PHONE)


# ------------------------------------------------------------------------------------ helpers


def load(page, srv) -> None:
    page.goto(srv.base_url + "/")
    expect(page.locator("#prompt")).to_be_visible()
    expect(page.locator("#messages")).to_be_attached()


def configure(page, max_tokens: int, temperature: str | None = None) -> None:
    open_settings(page)
    set_control(page, "#max-tokens", str(max_tokens))
    if temperature is not None:
        set_control(page, "#temperature", temperature)


def send(page, text: str) -> None:
    page.locator("#prompt").fill(text)
    page.locator("#prompt").press("Enter")


def last_reply(page):
    return page.locator("#messages .msg.assistant").last


def wait_reply_done(page) -> str:
    """Wait for the last answer's stats line (``tok/s``); the answer's text."""
    reply = last_reply(page)
    expect(reply.locator(".stats")).to_contain_text("tok/s", timeout=REPLY_TIMEOUT_MS)
    return reply.evaluate(REPLY_TEXT)


def shot(target, name: str) -> Path:
    """A PNG of ``target`` (a page or a locator) as docs/screenshots/NAME, checked to be one."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    target.screenshot(path=str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, f"{path} is not a screenshot"
    return path


# ------------------------------------------------------------------------------------ chat


def test_enter_sends_and_the_answer_streams_in_with_its_stats(page, console):
    pg, _seen = page
    load(pg, console)
    configure(pg, max_tokens=32, temperature="0")
    prompt = pg.locator("#prompt")
    # an answer of ~18 tokens (greedy): long enough to be drawn in more than one frame
    prompt.fill("Tell me about the capital of France.")
    prompt.press("Shift+Enter")  # a newline, not a send
    prompt.press_sequentially("Answer in three sentences.")
    assert "\n" in prompt.input_value(), "Shift+Enter did not put a newline into #prompt"
    expect(pg.locator("#messages .msg.user")).to_have_count(0)

    pg.evaluate(WATCH_REPLY)
    prompt.press("Enter")
    user_msg = pg.locator("#messages .msg.user")
    expect(user_msg).to_have_count(1)
    expect(user_msg).to_contain_text("capital of France")
    expect(user_msg).to_contain_text("Answer in three sentences.")
    text = wait_reply_done(pg)
    assert text, "the answer is empty"
    expect(pg.locator("#messages .msg.assistant")).to_have_count(1)
    seen = pg.evaluate("window.__seen")
    partial = {n for n, has_stats in seen if n > 0 and not has_stats}
    assert len(partial) >= 2, f"the answer did not stream in (lengths before the stats: {sorted(partial)})"
    assert re.search(r"\d+(\.\d+)?\s*tok/s", last_reply(pg).locator(".stats").inner_text())
    shot(pg, "chat.png")

    pg.locator("#new-chat").click()
    expect(pg.locator("#messages .msg")).to_have_count(0)


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_ends_a_long_generation_and_frees_the_slot(page, console, how):
    pg, _seen = page
    before = wait_health(console.base_url, lambda h: h["active"] == 0, HEALTH_TIMEOUT_S, "no slot in use")
    load(pg, console)
    configure(pg, max_tokens=400)
    send(pg, LONG_Q)
    pg.wait_for_function(
        "() => { const m = [...document.querySelectorAll('#messages .msg.assistant')].pop();"
        " return m && m.textContent.trim().length > 10; }",
        timeout=REPLY_TIMEOUT_MS)
    wait_health(console.base_url, lambda h: h["active"] == 1, HEALTH_TIMEOUT_S, "the generation's slot")

    if how == "button":
        expect(pg.locator("#stop")).to_be_visible()
        pg.locator("#stop").click()
    else:
        pg.locator("#prompt").focus()
        pg.keyboard.press("Escape")

    after = wait_health(console.base_url, lambda h: h["active"] == 0, HEALTH_TIMEOUT_S, "the slot free")
    counts = {k: (before[k], after[k]) for k in ("completed", "cancelled", "failed")}
    assert after["cancelled"] == before["cancelled"] + 1, f"no cancel (before, after): {counts}"
    assert after["completed"] == before["completed"], f"the generation ran to its end: {counts}"
    stopped = last_reply(pg).evaluate(REPLY_TEXT)
    assert stopped, "the stopped answer lost its text"
    expect(pg.locator("#send")).to_be_enabled()


# The console's SSE reader (colibri/api/web/sse.js), imported alone in the page: a stream cut at
# awkward places, CRLF line ends, a line that is not JSON, an error chunk, the closing [DONE].
READ_SSE = r"""async () => {
    const { chatChunks } = await import('/sse.js');
    const parts = [
        'data: {"choices":[{"delta":{"content":"Hel"}}]}\r\n\r\ndata: {"choi',
        'ces":[{"delta":{"content":"lo"},"finish_reason":"stop"}]}\n',
        '\ndata: not json\n\n: a comment\n\ndata: {"error":{"message":"boom"}}\n\ndata: [DONE]\n\n',
    ];
    const enc = new TextEncoder();
    const body = new ReadableStream({
        start(c) { parts.forEach((p) => c.enqueue(enc.encode(p))); c.close(); },
    });
    const out = [];
    for await (const chunk of chatChunks(body)) out.push(chunk);
    return out;
}"""


def test_the_stats_line_says_what_speculative_decoding_accepted(page, console):
    """A copying answer drafts by prompt lookup (the server's default): its stats line says how many
    draft tokens were accepted of those verified."""
    pg, _seen = page
    load(pg, console)
    configure(pg, max_tokens=48, temperature="0")
    send(pg, "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
             "kiwi, lemon, mango, nectarine.")
    wait_reply_done(pg)
    stats = last_reply(pg).locator(".stats").inner_text()
    match = re.search(r"drafts (\d+)/(\d+) accepted", stats)
    assert match and 0 < int(match[1]) <= int(match[2]), stats


def test_the_sse_reader_stands_alone(page, console):
    """sse.js needs no DOM and no page state: a module of its own, testable by itself."""
    pg, _seen = page
    load(pg, console)
    got = pg.evaluate(READ_SSE)
    assert [c.get("piece") for c in got] == ["Hel", "lo", None], got
    assert got[1]["finish"] == "stop" and got[0]["finish"] is None, got
    assert got[2] == {"error": "boom"}, got


# ------------------------------------------------------------------------------------ runtime


def test_runtime_panel_names_the_model_and_the_dense_model_has_no_experts(page, console):
    pg, _seen = page
    load(pg, console)
    expect(pg.locator("#runtime")).to_be_visible()
    expect(pg.locator("#model-name")).to_contain_text(console.model_id)
    expect(pg.locator("#no-experts")).to_be_visible()
    configure(pg, max_tokens=16)
    send(pg, "Name three colours.")
    wait_reply_done(pg)
    expect(pg.locator("#tps-trend")).to_be_attached()
    shot(pg.locator("#runtime"), "runtime.png")


def _distinct_cells(srv) -> tuple[bytes, int]:
    """The server's expert map now (/experts), and how many distinct cells (tier, heat) it holds."""
    cells = bytes.fromhex(httpx.get(srv.base_url + "/experts", timeout=10).json()["map"])
    return cells, len(set(cells))


def test_expert_map_draws_and_changes_after_a_turn(page, tiny_gguf):
    """On a server of its own, started cold: the module's shared server has served other tests'
    turns, and the routing of the tiny random Mixtral is near uniform, so after enough turns every
    expert's heat can fall in one bucket (one colour, as the page rightly draws). Shown: the page
    draws exactly the distinct cells of the server's map, before the turn and after it."""
    pg, _seen = page
    with running_server(*moe_args(tiny_gguf)) as srv:
        load(pg, srv)
        expect(pg.locator("#model-name")).to_contain_text(srv.model_id)
        expect(pg.locator("#experts-panel")).to_be_visible()
        expect(pg.locator("#expert-map")).to_be_visible()
        expect(pg.locator("#no-experts")).to_be_hidden()
        canvas = pg.locator("#expert-map").element_handle()
        pg.wait_for_function(f"(c) => ({CANVAS_PIXELS})(c).painted > 0", arg=canvas, timeout=UI_TIMEOUT_MS)
        cold, cold_distinct = _distinct_cells(srv)
        before = canvas_pixels(pg, "#expert-map")
        assert before["width"] > 0 and before["height"] > 0 and before["colors"] == cold_distinct, before

        configure(pg, max_tokens=24)
        send(pg, "hello there")
        wait_reply_done(pg)
        warm, warm_distinct = _distinct_cells(srv)  # the turn is over: the heat holds still
        assert warm != cold, "the turn routed no expert"
        # the page's next poll draws it; the routed experts' flash ends; then one colour per cell value
        drawn_anew = f"""([c, h, n]) => {{
            const p = ({CANVAS_PIXELS})(c);
            return p.hash !== h && p.colors === n;
        }}"""
        pg.wait_for_function(drawn_anew, arg=[canvas, before["hash"], warm_distinct], timeout=UI_TIMEOUT_MS)
        after = wait_canvas_still(pg, "#expert-map", UI_TIMEOUT_MS)
        assert after["painted"] > 0 and after["colors"] == warm_distinct, (after, warm.hex())
        assert after["hash"] != before["hash"], "the map is as it was before the turn"
        shot(pg.locator("#experts-panel"), "expert-map.png")


def test_expert_tip_names_the_cell_under_the_pointer(page, moe_server):
    pg, _seen = page
    load(pg, moe_server)
    canvas = pg.locator("#expert-map")
    pg.wait_for_function(f"(c) => ({CANVAS_PIXELS})(c).painted > 0", arg=canvas.element_handle())
    box = canvas.bounding_box()
    assert box and box["width"] > 0 and box["height"] > 0, box
    pg.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    tip = pg.locator("#expert-tip")
    expect(tip).to_be_visible()
    expect(tip).to_have_text(re.compile(r"\d"))  # a layer and an expert, by number


# ------------------------------------------------------------------------------------ safety


def test_hostile_model_output_renders_as_text(page, console):
    """The answer's stream is the server's own, with its text swapped for HTML (page.route)."""
    pg, seen = page

    def hostile(route):
        real = route.fetch()
        if real.status != 200:  # the page shows the server's error, and the test fails on it
            return route.fulfill(response=real)
        route.fulfill(status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
                      body=with_content(sse_frames(real.body()), XSS_PIECES))

    pg.route("**/v1/chat/completions", hostile)
    load(pg, console)
    configure(pg, max_tokens=4)
    send(pg, "Say hi.")
    text = wait_reply_done(pg)
    assert "".join(XSS_PIECES).strip() in text, f"the answer's text is not the model's, literally: {text!r}"
    assert pg.locator("#messages script").count() == 0
    assert pg.locator("#messages img").count() == 0
    assert pg.evaluate("typeof window.__pwned") == "undefined"
    assert not [u for u in seen.requests if u.rstrip("/").endswith("/x")], "the <img> was loaded"


def test_the_page_talks_only_to_its_own_server(page, console):
    pg, seen = page
    load(pg, console)
    configure(pg, max_tokens=8)
    send(pg, "Hi")
    wait_reply_done(pg)
    assert any(u.endswith("/v1/chat/completions") for u in seen.requests), seen.requests
    assert seen.foreign(console.base_url) == [], f"requests to other hosts: {seen.foreign(console.base_url)}"


def test_no_horizontal_overflow_on_a_phone(phone, console):
    pg, _seen = phone
    load(pg, console)
    width = "() => Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)"
    assert pg.evaluate(width) <= PHONE["width"], "the page overflows before any message"
    configure(pg, max_tokens=16)
    assert pg.evaluate(width) <= PHONE["width"], "the open settings drawer overflows"
    assert pg.evaluate(OVERFLOWING, PHONE["width"]) == [], "the open settings drawer is cut off"
    send(pg, f"Repeat this word: {LONG_WORD}")
    expect(pg.locator("#messages .msg.user")).to_contain_text(LONG_WORD[:40])
    wait_reply_done(pg)
    assert pg.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    assert pg.evaluate(width) <= PHONE["width"]
    assert pg.evaluate(OVERFLOWING, PHONE["width"]) == [], "cut off or scrolling sideways after the answer"


# ------------------------------------------------------------------------------------ atlas

ATLAS_PROMPTS = {"counting": [[1, 2, 3, 4, 5], [6, 7, 8, 9]], "letters": [[40, 41, 42], [43, 44, 45, 46]]}


@pytest.fixture(scope="module")
def atlas_server(tiny_gguf, tmp_path_factory):
    """``coli serve`` on the tiny Mixtral with a state directory holding the ``coli atlas`` it measured
    (token-id prompts: the tiny model has no tokenizer)."""
    work = tmp_path_factory.mktemp("web-atlas")
    state = work / "state"
    state.mkdir()
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(ATLAS_PROMPTS))
    done = subprocess.run(
        [sys.executable, "-m", "colibri", "atlas", "--model", str(tiny_gguf), "--prompts", str(prompts),
         "--out", str(state / "experts.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    with running_server(*moe_args(tiny_gguf), "--state-dir", str(state)) as srv:
        _console_served(srv)
        yield srv


def test_atlas_view_draws_the_measured_atlas(page, atlas_server):
    pg, _seen = page
    atlas = httpx.get(atlas_server.base_url + "/atlas", timeout=10).json()
    assert atlas["topics"] == list(ATLAS_PROMPTS), atlas
    load(pg, atlas_server)
    expect(pg.locator("#atlas-panel")).to_be_visible()
    expect(pg.locator("#atlas-map")).to_be_visible()
    expect(pg.locator("#no-atlas")).to_be_hidden()
    canvas = pg.locator("#atlas-map").element_handle()
    pg.wait_for_function(f"(c) => ({CANVAS_PIXELS})(c).painted > 0", arg=canvas)
    drawn = canvas_pixels(pg, "#atlas-map")
    assert drawn["painted"] > 0 and drawn["colors"] >= 2, drawn
    legend = pg.locator("#atlas-legend")
    expect(legend).to_be_visible()
    for topic in ATLAS_PROMPTS:
        expect(legend).to_contain_text(topic)

    # The expert map's tooltip adds the hovered expert's measured affinity
    expert_map = pg.locator("#expert-map")
    pg.wait_for_function(f"(c) => ({CANVAS_PIXELS})(c).painted > 0", arg=expert_map.element_handle())
    box = expert_map.bounding_box()
    assert box and box["width"] > 0 and box["height"] > 0, box
    pg.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    expect(pg.locator("#expert-tip")).to_contain_text("affinity:")


def test_no_atlas_on_the_dense_server(page, console):
    pg, _seen = page
    assert httpx.get(console.base_url + "/atlas", timeout=10).status_code == 404
    load(pg, console)
    expect(pg.locator("#atlas-panel")).to_be_visible()
    expect(pg.locator("#no-atlas")).to_be_visible()
    expect(pg.locator("#no-atlas")).to_have_text("No atlas yet: run coli atlas --prompts FILE")
    expect(pg.locator("#atlas-map")).to_be_hidden()

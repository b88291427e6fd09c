"""Drive the web console in a real browser: Playwright for Python on Debian's Chromium.

The browser is ``/usr/bin/chromium`` (``make test`` installs it with apt-get; a browser download is
never made). Without it the browser tests skip, with the reason the Makefile's set-up step left in
``.venv/.browser-missing`` when it could not install it. Each test gets a fresh browser context (no
cookies, no storage) that records every request and every uncaught page error.

Also: reading a canvas's pixels (2-D or WebGL: it is copied onto a 2-D canvas first), setting a
form control the way a user's edit would, /health polling, and rewriting a real SSE answer's text
(for the test that feeds the page hostile model output).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
ROOT = Path(__file__).resolve().parent.parent
BROWSER_NOTE = ROOT / ".venv" / ".browser-missing"  # written by the Makefile's browser step
# The PNGs the issue asks for; COLI_SCREENSHOT_DIR sends them elsewhere (CI artifacts).
SCREENSHOTS = Path(os.environ.get("COLI_SCREENSHOT_DIR") or ROOT / "docs" / "screenshots")
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def missing_browser() -> str | None:
    """Why the browser tests cannot run, or None when Chromium is there."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return None
    why = BROWSER_NOTE.read_text().strip() if BROWSER_NOTE.is_file() else "not installed"
    return (f"the browser tests need Debian's Chromium at {CHROMIUM}: {why} "
            "(`make test` installs it with `apt-get install chromium`)")


def launch(playwright):
    """Headless Chromium with its own fresh temporary profile (a normal launch makes one)."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)


@dataclass
class Recorded:
    """What one browser context saw: every request's URL, every uncaught error of its pages."""

    requests: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def foreign(self, origin: str) -> list[str]:
        """The requests that went anywhere but ``origin`` (data: and blob: URLs stay in the page)."""
        return [u for u in self.requests
                if urlsplit(u).scheme not in ("data", "blob") and origin_of(u) != origin]


def origin_of(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


def open_context(browser, viewport: dict[str, int]):
    """A fresh context and page that record into a ``Recorded``."""
    context = browser.new_context(viewport=viewport)
    seen = Recorded()
    context.on("request", lambda r: seen.requests.append(r.url))
    page = context.new_page()
    page.on("pageerror", lambda e: seen.page_errors.append(str(e)))
    return context, page, seen


# ------------------------------------------------------------------------------------ the page


def set_control(page, selector: str, value: str) -> None:
    """Set an input (number, range or text) or textarea as an edit would: the value, then the
    ``input`` and ``change`` events the page listens for. The control must be visible."""
    el = page.locator(selector)
    el.wait_for(state="visible")
    el.evaluate(
        """(el, v) => {
            el.value = v;
            el.dispatchEvent(new Event('input', {bubbles: true}));
            el.dispatchEvent(new Event('change', {bubbles: true}));
        }""",
        value,
    )


def open_settings(page) -> None:
    """Open the settings drawer (a <details>) by clicking its summary, as a user does."""
    drawer = page.locator("#settings")
    if not drawer.evaluate("d => d.open"):
        drawer.locator("summary").first.click()
    assert drawer.evaluate("d => d.open"), "clicking the summary of #settings did not open it"


# A canvas's pixels, whatever draws it: copied onto a 2-D canvas (WebGL included, as displayed).
CANVAS_PIXELS = """(c) => {
    const o = document.createElement('canvas');
    o.width = c.width; o.height = c.height;
    if (!o.width || !o.height) return {width: o.width, height: o.height, painted: 0, colors: 0, hash: 0};
    const g = o.getContext('2d');
    g.drawImage(c, 0, 0);
    const d = g.getImageData(0, 0, o.width, o.height).data;
    let painted = 0, hash = 2166136261;
    const colors = new Set();
    for (let i = 0; i < d.length; i += 4) {
        const px = (d[i] << 24 | d[i + 1] << 16 | d[i + 2] << 8 | d[i + 3]) >>> 0;
        if (d[i + 3]) { painted++; if (colors.size < 64) colors.add(px); }
        hash = Math.imul(hash ^ px, 16777619) >>> 0;
    }
    return {width: o.width, height: o.height, painted, colors: colors.size, hash};
}"""


def canvas_pixels(page, selector: str) -> dict:
    """``{width, height, painted, colors, hash}``: non-transparent pixels, distinct colours among
    them (up to 64), and a hash of every pixel."""
    return page.locator(selector).evaluate(CANVAS_PIXELS)


def wait_canvas_still(page, selector: str, timeout_ms: int) -> dict:
    """Wait until the canvas shows the same pixels at two samples 300 ms apart (an animation, such
    as the expert map's flash of routed experts, has ended); its pixels then."""
    page.locator(selector).evaluate(
        f"""async (c, timeout) => {{
            const pixels = {CANVAS_PIXELS};
            const end = performance.now() + timeout;
            let last = pixels(c).hash;
            while (performance.now() < end) {{
                await new Promise(r => setTimeout(r, 300));
                const now = pixels(c).hash;
                if (now === last) return;
                last = now;
            }}
            throw new Error('the canvas kept changing');
        }}""",
        timeout_ms,
    )
    return canvas_pixels(page, selector)


# ------------------------------------------------------------------------------------ the server


def health(base_url: str) -> dict:
    return httpx.get(base_url + "/health", timeout=10).json()


def wait_health(base_url: str, predicate, timeout: float, what: str) -> dict:
    """Poll /health until ``predicate(body)``; that body, or AssertionError with the last one."""
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        last = health(base_url)
        if predicate(last):
            return last
        time.sleep(0.05)
    raise AssertionError(f"/health never showed {what} in {timeout:.0f}s; last: {last}")


# ------------------------------------------------------------------------------------ SSE


def sse_frames(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    out = []
    for event in body.decode().replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def with_content(frames: list[str], pieces: list[str]) -> bytes:
    """A real chat stream's frames with its text replaced by ``pieces``: every chunk that carries
    text is dropped, and one chunk per piece (a copy of the first chunk) follows the role chunk;
    the finish, usage and [DONE] frames stay as the server sent them."""
    chunks = [json.loads(f) for f in frames if f != "[DONE]"]
    assert chunks and chunks[0].get("choices"), f"not a chat stream: {frames[:3]}"
    kept = [c for c in chunks if not any(ch.get("delta", {}).get("content") for ch in c.get("choices", []))]
    template = chunks[0]
    made = []
    for piece in pieces:
        c = json.loads(json.dumps(template))
        c["choices"][0]["delta"] = {"content": piece}
        c["choices"][0]["finish_reason"] = None
        made.append(c)
    out = kept[:1] + made + kept[1:]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in out) + b"data: [DONE]\n\n"

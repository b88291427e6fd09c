// The conversation as the reader sees it: the user's messages as text, the assistant's rendered
// from markdown as they stream, each answer closed by its stats line. The list follows a
// streaming answer unless the reader has scrolled up.

import { renderMarkdown } from "./markdown.js";

const list = () => document.getElementById("messages");

function stickyScroll(change) {
  const m = list();
  const atBottom = m.scrollHeight - m.scrollTop - m.clientHeight < 48;
  change();
  if (atBottom) m.scrollTop = m.scrollHeight;
}

export function clearMessages() {
  list().replaceChildren();
}

export function addUser(text) {
  const div = document.createElement("div");
  div.className = "msg user";
  div.textContent = text;
  stickyScroll(() => list().append(div));
  return div;
}

/** A thinking model's reasoning, folded above the answer ``body`` of ``div``: a closed <details>
 *  the reader opens, made when the first reasoning comes. Plain text (whitespace kept), never
 *  markup. */
function foldedReasoning(div, body) {
  let text = "";
  let el = null;
  return {
    get text() {
      return text;
    },
    add(piece) {
      if (!el) {
        el = { details: document.createElement("details"), summary: document.createElement("summary") };
        el.details.className = "reasoning";
        el.summary.textContent = "Thinking…";
        el.text = document.createElement("div");
        el.text.className = "reasoning-text";
        el.details.append(el.summary, el.text);
        div.insertBefore(el.details, body);
      }
      text += piece;
      stickyScroll(() => (el.text.textContent = text)); // plain text: cheap to set per piece
    },
    settle() {
      if (el) el.summary.textContent = "Reasoning";
    },
  };
}

/** The assistant's message: its text re-rendered at most once a frame while it streams, and a
 *  thinking model's reasoning, as it comes, folded above it. */
export function startReply() {
  const div = document.createElement("div");
  div.className = "msg assistant streaming";
  const body = document.createElement("div");
  body.className = "body";
  div.append(body);
  stickyScroll(() => list().append(div));
  const reasoning = foldedReasoning(div, body);
  let text = "";
  let frame = 0;
  const render = () => { // the answer's text: once it shows (or the reply ended), the reasoning is whole
    frame = 0;
    reasoning.settle();
    stickyScroll(() => body.replaceChildren(renderMarkdown(text)));
  };
  return {
    div,
    reasoning, // a thinking model's: add(piece) as it comes; .text
    get text() {
      return text;
    },
    append(piece) {
      text += piece;
      if (!frame) frame = requestAnimationFrame(render);
    },
    end() {
      if (frame) cancelAnimationFrame(frame);
      render();
      div.classList.remove("streaming");
    },
    fail(message) {
      this.end();
      div.classList.add("failed");
      stickyScroll(() => div.append(errorLine(message)));
    },
    stats(items) {
      stickyScroll(() => div.append(statsLine(items)));
    },
  };
}

function errorLine(message) {
  const p = document.createElement("p");
  p.className = "msg-error";
  p.textContent = message;
  return p;
}

/** ``items``: [key, label] pairs, each a span with ``data-stat=key``. */
function statsLine(items) {
  const line = document.createElement("div");
  line.className = "stats";
  for (const [key, label] of items) {
    if (line.childNodes.length) line.append(" · "); // readable as text too, not only laid out
    const span = document.createElement("span");
    span.dataset.stat = key;
    span.textContent = label;
    line.append(span);
  }
  return line;
}

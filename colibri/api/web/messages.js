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

/** A thinking model's reasoning, folded above the answer: a <details> the reader opens. Plain
 *  text (whitespace kept), never markup. */
function reasoningBlock() {
  const details = document.createElement("details");
  details.className = "reasoning";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking…";
  const text = document.createElement("div");
  text.className = "reasoning-text";
  details.append(summary, text);
  return { details, summary, text };
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
  let text = "";
  let reasoning = "";
  let block = null; // the folded reasoning, once some came
  let frame = 0;
  const render = () => {
    frame = 0;
    stickyScroll(() => {
      body.replaceChildren(renderMarkdown(text));
      if (block) block.text.textContent = reasoning;
    });
  };
  return {
    div,
    get text() {
      return text;
    },
    get reasoning() {
      return reasoning;
    },
    think(piece) {
      if (!block) {
        block = reasoningBlock();
        div.insertBefore(block.details, body);
      }
      reasoning += piece;
      if (!frame) frame = requestAnimationFrame(render);
    },
    append(piece) {
      text += piece;
      if (block) block.summary.textContent = "Reasoning";
      if (!frame) frame = requestAnimationFrame(render);
    },
    end() {
      if (frame) cancelAnimationFrame(frame);
      render();
      if (block) block.summary.textContent = "Reasoning";
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

// The conversation: the composer sends a turn with the history so far, its answer streams into
// the message list, Stop (or Escape) aborts it, "New chat" starts over. Only finished turns of
// the current chat join the history the next request sends.

import { errorMessage, modelId, postChat } from "./api.js";
import { addUser, clearMessages, startReply } from "./messages.js";
import { chatChunks } from "./sse.js";
import { completionTokens, queueWait, record, startTurn, statItems, tokPerS } from "./stats.js";

const state = {
  history: [], // the finished turns the next request sends: {role, content}
  controller: null, // the AbortController of the answer streaming now
  chat: 0, // bumped by "New chat": an answer of an older chat leaves the history alone
  pendingSend: false, // a message refused with 401: sent again once a key is accepted
};
let el = null;
let page = null; // what the chat asks of the rest of the page: see initChat

/** Wire the composer. ``settings``: {sampling(), system()}; ``hasExperts()``: the model has an
 *  expert map; ``onSpeed(tokPerS)``: a finished turn's decode speed. Returns ``{resume()}``, to
 *  call once a key is accepted. */
export function initChat(settings, hasExperts, onSpeed) {
  const $ = (id) => document.getElementById(id);
  el = { prompt: $("prompt"), send: $("send"), stop: $("stop"), liveTokens: $("live-tokens") };
  page = { settings, hasExperts, onSpeed };
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sendNow();
  });
  el.prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      sendNow();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && state.controller) {
      ev.preventDefault();
      stop();
    }
  });
  el.stop.addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  return { resume };
}

// send() handles what a request can do wrong; anything else is a bug, logged, not swallowed whole
const sendNow = () => send().catch((err) => console.error("colibri console:", err));

function stop() {
  state.controller?.abort(); // the server sees the disconnect and cancels the request in the engine
}

function newChat() {
  stop();
  state.chat += 1;
  state.history = [];
  clearMessages();
  el.liveTokens.textContent = "0";
  el.prompt.focus();
}

/** After a key was accepted: the message that waited for it goes out. */
function resume() {
  if (!state.pendingSend) return el.prompt.focus();
  state.pendingSend = false;
  sendNow();
}

async function send() {
  const text = el.prompt.value;
  if (state.controller || !text.trim()) return;
  el.prompt.value = "";
  const chat = state.chat;
  const userTurn = { role: "user", content: text };
  const userDiv = addUser(text);
  const reply = startReply();
  const turn = await exchange(requestBody(userTurn), reply);
  if (turn === null) { // asked for a key: the message waits for it, back in the box
    userDiv.remove();
    reply.div.remove();
    el.prompt.value = text;
    state.pendingSend = true;
    return;
  }
  const nothing = turn.stopped && !reply.text && !reply.reasoning.text;
  const failure = turn.error || (nothing ? "Stopped before the answer began." : "");
  if (failure) {
    reply.fail(failure);
    userDiv.classList.add("failed");
    return;
  }
  reply.end();
  // the answer alone: a thinking model's reasoning is not sent back (its template drops it anyway)
  if (chat === state.chat) state.history.push(userTurn, { role: "assistant", content: reply.text });
  finished(turn, reply);
}

function requestBody(userTurn) {
  const system = page.settings.system();
  const body = {
    messages: [...(system ? [{ role: "system", content: system }] : []), ...state.history, userTurn],
    stream: true,
    stream_options: { include_usage: true },
    ...page.settings.sampling(),
  };
  if (modelId()) body.model = modelId();
  return body;
}

/** Send ``body`` and stream its answer into ``reply``: the turn's record, or null when the server
 *  asked for a key. */
async function exchange(body, reply) {
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  el.liveTokens.textContent = "0";
  const turn = startTurn();
  try {
    const res = await postChat(body, controller.signal);
    if (res.status === 401) return null;
    if (!res.ok) {
      turn.error = await errorMessage(res);
      return turn;
    }
    turn.queueMs = queueWait(res.headers);
    for await (const chunk of chatChunks(res.body)) {
      record(turn, chunk);
      if (chunk.piece || chunk.reasoning) el.liveTokens.textContent = String(turn.pieces);
      if (chunk.reasoning) reply.reasoning.add(chunk.reasoning);
      if (chunk.piece) reply.append(chunk.piece);
    }
  } catch (err) {
    if (err?.name === "AbortError") turn.stopped = true;
    else turn.error = "The server is unreachable or the connection broke.";
  } finally {
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
  return turn;
}

function setBusy(busy) {
  el.send.disabled = busy;
  el.stop.disabled = !busy;
}

/** A finished (or stopped) answer: its token count, its stats line, its speed for the trend. */
function finished(turn, reply) {
  el.liveTokens.textContent = String(completionTokens(turn));
  const tps = tokPerS(turn);
  if (!turn.stopped && tps !== undefined) page.onSpeed(tps);
  reply.stats(statItems(turn, page.hasExperts()));
}

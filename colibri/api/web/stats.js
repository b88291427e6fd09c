// One answer's live metrics: time to first token, tokens as they arrive, then colibri's own stats
// (tok/s, expert hits, reused KV) and the usage the stream ends with, as the stats line's items.

import { fmtMs, fmtNum } from "./format.js";

const QUEUE_WAIT_HEADER = "x-colibri-queue-wait-ms";

/** A turn's record, started when its request leaves. */
export function startTurn() {
  return {
    t0: performance.now(), ttft: null, pieces: 0, colibri: null, usage: null, finish: null,
    error: null, stopped: false, queueMs: null,
  };
}

/** How long the request waited for a slot, from the response's header; null if not said. */
export function queueWait(headers) {
  const waited = Number(headers.get(QUEUE_WAIT_HEADER));
  return headers.has(QUEUE_WAIT_HEADER) && Number.isFinite(waited) ? waited : null;
}

/** Count one read chunk (sse.js's ``readChunk``) into the turn. */
export function record(turn, chunk) {
  if (chunk.error) {
    turn.error = chunk.error;
    return;
  }
  if (chunk.piece || chunk.reasoning) { // reasoning is generated text too: the first token's time
    if (turn.ttft === null) turn.ttft = performance.now() - turn.t0;
    turn.pieces += 1; // one SSE chunk per token the engine emits (usage corrects the count)
  }
  if (chunk.finish) turn.finish = chunk.finish;
  if (chunk.colibri) turn.colibri = { ...turn.colibri, ...chunk.colibri }; // finish chunk, then usage chunk
  if (chunk.usage) turn.usage = chunk.usage;
}

/** The tokens generated: the usage's count, else colibri's, else the chunks seen. */
export function completionTokens(turn) {
  return turn.usage?.completion_tokens ?? turn.colibri?.stats?.emitted ?? turn.pieces;
}

/** The decode speed colibri measured, or undefined (another server, or none yet). */
export function tokPerS(turn) {
  const tps = turn.colibri?.stats?.tok_s;
  return Number.isFinite(tps) ? tps : undefined;
}

/** The stats line: [key, label] pairs. ``experts``: the model has an expert map, so its hit rate
 *  means something. */
export function statItems(turn, experts) {
  const stats = turn.colibri?.stats;
  const items = [];
  if (turn.stopped) items.push(["stopped", "stopped"]);
  const tps = tokPerS(turn);
  if (tps !== undefined) items.push(["tok-s", `${fmtNum(tps)} tok/s`]);
  else if (!turn.stopped) items.push(["tok-s", "— tok/s"]); // a server without colibri's stats: same shape
  if (turn.ttft !== null) items.push(["ttft", `TTFT ${fmtMs(turn.ttft)}`]);
  const prompt = turn.usage?.prompt_tokens ?? stats?.prompt_tokens;
  if (prompt !== undefined) items.push(["prompt-tokens", `${prompt} prompt`]);
  items.push(["completion-tokens", `${completionTokens(turn)} completion tokens`]);
  if (turn.queueMs !== null) items.push(["queue-wait", `queue ${fmtMs(turn.queueMs)}`]);
  const reused = turn.colibri?.perf?.reused_tokens;
  if (reused) items.push(["reused-tokens", `${reused} reused from the KV cache`]);
  const drafted = turn.colibri?.perf?.drafted_tokens;
  if (drafted) {
    // speculative decoding: draft tokens accepted of those verified
    items.push(["drafts", `drafts ${turn.colibri.perf.accepted_tokens}/${drafted} accepted`]);
  }
  if (experts && Number.isFinite(stats?.hit_pct)) {
    items.push(["hit-pct", `experts ${fmtNum(stats.hit_pct)}% in RAM`]);
  }
  if (turn.finish === "length") items.push(["length", "cut at max tokens"]);
  return items;
}

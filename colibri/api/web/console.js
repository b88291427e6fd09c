// The colibri web console: a same-origin client of the server that serves it (docs/api.md, "Web
// console"). Vanilla JS, no build step, nothing fetched from any other host: every URL is a path.
//
// Safety rule: text from outside the page (model output, error messages, anything in a response)
// enters the DOM only as text nodes or textContent, never as markup. The markdown renderer builds
// its few elements itself and links only http(s) URLs.

const POLL_MS = 2000;
const KEY_STORE = "colibri.apiKey"; // sessionStorage: the key lives as long as the tab
const SETTINGS_STORE = "colibri.settings"; // localStorage: sampling settings and system prompt
const QUEUE_WAIT_HEADER = "x-colibri-queue-wait-ms";
const TREND_TURNS = 30;
const HEAT_MAX = 63; // EMAP: (tier << 6) | heat, heat 0..63 (docs/serve_protocol.md)
const TIER_NAMES = ["disk", "RAM", "VRAM"];
const TIER_RGB = [[70, 120, 230], [40, 190, 110], [200, 90, 230]]; // as the legend's swatches
const FLASH_DECAY = 0.94; // per frame: a routed expert fades back to its colour in about a second
const MAP_MAX_HEIGHT = 420; // CSS px: a 94-layer map stays on screen beside the chat
const ATLAS_POLL_MS = 30000; // /atlas changes only when `coli atlas` runs again
const ATLAS_MAX_SIDE = 360; // CSS px
const ATLAS_UNUSED = "rgb(140, 140, 140)";
const ATLAS_COLORS = [
  "rgb(230, 85, 70)", "rgb(60, 130, 230)", "rgb(40, 175, 95)", "rgb(235, 160, 30)", "rgb(170, 90, 220)",
  "rgb(30, 180, 190)", "rgb(225, 90, 170)", "rgb(130, 160, 40)", "rgb(150, 100, 60)", "rgb(90, 90, 200)",
];

// ------------------------------------------------------------------------------ markdown

const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
// code, **bold**, *italic*, [text](url); the markers need a non-space inside, so "2 * 3 * 4" stays
const INLINE = /`([^`\n]+)`|\*\*(\S(?:.*?\S)?)\*\*|\*([^\s*](?:[^*\n]*?[^\s*])?)\*|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

/** Markdown text as a DocumentFragment: paragraphs, headings, lists, fenced code, `code`, **bold**,
 *  *italic* and http(s) links. Everything else, HTML included, stays literal text. */
export function renderMarkdown(text, doc = document) {
  const frag = doc.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  const flush = () => {
    if (!para.length) return;
    const p = doc.createElement("p");
    para.forEach((line, k) => {
      if (k) p.append(doc.createElement("br")); // the model's line breaks are meant
      appendInline(p, line, doc);
    });
    frag.append(p);
    para = [];
  };
  for (let i = 0; i < lines.length; ) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flush();
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
      i++; // the closing fence; a block still streaming shows as code so far
      const pre = doc.createElement("pre");
      const code = doc.createElement("code");
      if (fence[2]) code.setAttribute("data-lang", fence[2]);
      code.textContent = body.join("\n");
      pre.append(code);
      frag.append(pre);
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      const h = doc.createElement(`h${Math.min(5, heading[1].length + 2)}`); // below the page's own
      appendInline(h, heading[2], doc);
      frag.append(h);
      i++;
      continue;
    }
    const item = LIST_ITEM.exec(line);
    if (item) {
      flush();
      const ordered = /\d/.test(item[1]);
      const list = doc.createElement(ordered ? "ol" : "ul");
      if (ordered && parseInt(item[1], 10) !== 1) list.setAttribute("start", String(parseInt(item[1], 10)));
      while (i < lines.length) {
        const m = LIST_ITEM.exec(lines[i]);
        if (!m || /\d/.test(m[1]) !== ordered) break;
        const li = doc.createElement("li");
        appendInline(li, m[2], doc);
        list.append(li);
        // an indented line that is not an item continues the item
        for (i++; i < lines.length && /^\s{2,}\S/.test(lines[i]) && !LIST_ITEM.test(lines[i]); i++) {
          li.append(doc.createElement("br"));
          appendInline(li, lines[i].trim(), doc);
        }
      }
      frag.append(list);
      continue;
    }
    if (line.trim()) para.push(line);
    else flush();
    i++;
  }
  flush();
  return frag;
}

function appendInline(parent, text, doc) {
  const re = new RegExp(INLINE.source, "g");
  let last = 0;
  for (let m; (m = re.exec(text)); last = re.lastIndex) {
    if (m.index > last) parent.append(doc.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) {
      const code = doc.createElement("code");
      code.textContent = m[1];
      parent.append(code);
    } else if (m[2] !== undefined || m[3] !== undefined) {
      const node = doc.createElement(m[2] !== undefined ? "strong" : "em");
      appendInline(node, m[2] ?? m[3], doc);
      parent.append(node);
    } else {
      parent.append(link(m[4], m[5], m[0], doc));
    }
  }
  if (last < text.length) parent.append(doc.createTextNode(text.slice(last)));
}

function link(label, href, source, doc) {
  let url = null;
  try {
    url = new URL(href); // absolute URLs only: a relative one would point into this server
  } catch {
    url = null;
  }
  if (!url || (url.protocol !== "http:" && url.protocol !== "https:")) {
    return doc.createTextNode(source); // javascript:, data:, … stay the text they were
  }
  const a = doc.createElement("a");
  a.setAttribute("href", url.href);
  a.setAttribute("rel", "noopener noreferrer");
  a.setAttribute("target", "_blank");
  a.textContent = label;
  return a;
}

// ------------------------------------------------------------------------------ small helpers

/** Complete server-sent events of ``buffer``: their data, and the incomplete rest. */
export function splitEvents(buffer) {
  const events = [];
  const re = /\r?\n\r?\n/g;
  let start = 0;
  for (let m; (m = re.exec(buffer)); start = re.lastIndex) {
    const data = buffer
      .slice(start, m.index)
      .split(/\r?\n/)
      .filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5))
      .join("\n");
    if (data) events.push(data);
  }
  return { events, rest: buffer.slice(start) };
}

const HEX = new Uint8Array(128);
for (let k = 0; k < 16; k++) {
  HEX["0123456789abcdef".charCodeAt(k)] = k;
  HEX["0123456789ABCDEF".charCodeAt(k)] = k;
}

/** ``n`` bytes from a hex string (zeros where it is short): /experts' map and hits. */
export function hexBytes(hex, n) {
  const out = new Uint8Array(n);
  const m = Math.min(n, (hex || "").length >> 1);
  for (let i = 0; i < m; i++) {
    out[i] = (HEX[hex.charCodeAt(2 * i) & 127] << 4) | HEX[hex.charCodeAt(2 * i + 1) & 127];
  }
  return out;
}

/** Prometheus text as a Map of "name{labels}" to value. */
export function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    const m = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) out.set(m[1] + (m[2] || ""), Number(m[3]));
  }
  return out;
}

function fmtMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

function fmtNum(x, digits = 1) {
  return Number.isFinite(x) ? x.toFixed(digits) : "—";
}

function storage(kind) {
  try {
    return window[kind]; // absent or throwing where storage is disabled: the page still works
  } catch {
    return null;
  }
}

// ------------------------------------------------------------------------------ the page

if (typeof document !== "undefined" && document.getElementById("messages")) main();

function main() {
  const $ = (id) => document.getElementById(id);
  const el = {
    messages: $("messages"), prompt: $("prompt"), composer: $("composer"), send: $("send"),
    stop: $("stop"), newChat: $("new-chat"), liveTokens: $("live-tokens"),
    temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"), system: $("system-prompt"),
    banner: $("banner"), status: $("server-status"),
    keyForm: $("key-form"), apiKey: $("api-key"), keyError: $("key-error"),
    modelName: $("model-name"), blockTypes: $("block-types"), hwCpu: $("hw-cpu"), hwCores: $("hw-cores"),
    hwRam: $("hw-ram"), kvSlots: $("kv-slots"), queued: $("queued"), restarts: $("restarts"),
    tokensServed: $("tokens-served"), expertTiers: $("expert-tiers"), tpsTrend: $("tps-trend"),
    tpsLast: $("tps-last"),
    noExperts: $("no-experts"), expertsWait: $("experts-wait"), mapWrap: $("map-wrap"),
    canvas: $("expert-map"), tip: $("expert-tip"), legend: $("expert-legend"),
    noAtlas: $("no-atlas"), atlasMap: $("atlas-map"), atlasLegend: $("atlas-legend"),
  };
  const session = storage("sessionStorage");
  const local = storage("localStorage");
  const keep = (store, name, value) => {
    try {
      if (value) store?.setItem(name, value);
      else store?.removeItem(name);
    } catch {
      // storage full or refused (private modes): the value lasts as long as the page
    }
  };
  const state = {
    history: [], // the finished turns the next request sends: {role, content}
    controller: null, // the AbortController of the answer streaming now
    chat: 0, // bumped by "New chat": an answer of an older chat leaves the history alone
    apiKey: session?.getItem(KEY_STORE) || "",
    pendingSend: false, // a message refused with 401: sent again once a key is accepted
    modelId: null, // from /v1/models (or /health's model until then)
    tps: [], // tok/s of this page's last turns
    experts: false, // the model has an expert map (for the stats line's hit rate)
  };

  // ---------------------------------------------------------------- requests and the API key

  async function api(path, init = {}) {
    const headers = new Headers(init.headers || {});
    const sent = state.apiKey;
    if (sent) headers.set("Authorization", `Bearer ${sent}`);
    const res = await fetch(path, { ...init, headers, cache: "no-store" });
    if (res.status === 401) needKey(sent);
    return res;
  }

  /** A 401 to a request sent with key ``sent`` ("" for none). The answer to an older key (the
   * user entered another while it was in flight, or a poll left before the first key) says
   * nothing about the current one: it neither clears it nor shows an error. */
  function needKey(sent) {
    if (sent !== state.apiKey) return;
    if (sent) { // the key was sent and refused: it is the wrong one
      state.apiKey = "";
      keep(session, KEY_STORE, "");
      keyError("The server refused this API key (401 invalid_api_key). Check it and enter it again.");
    }
    if (el.keyForm.hidden) {
      el.keyForm.hidden = false;
      el.apiKey.focus();
    }
  }

  function keyError(message) {
    el.keyError.textContent = message;
    el.keyError.hidden = !message;
  }

  el.keyForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = el.apiKey.value.trim();
    // A header value must be visible ASCII; fetch would throw on anything else
    if (!/^[\x21-\x7e]+$/.test(key)) {
      keyError(key ? "An API key is printable ASCII without spaces." : "Enter the server's API key.");
      return;
    }
    state.apiKey = key;
    keep(session, KEY_STORE, key);
    keyError("");
    const answer = await loadModel(); // /v1/models checks the key
    if (answer === "failed") keyError("The key could not be checked: the server did not answer. Try again.");
    if (answer === "ok") {
      el.keyForm.hidden = true;
      el.apiKey.value = "";
      if (state.pendingSend) {
        state.pendingSend = false;
        sendNow();
      } else {
        el.prompt.focus();
      }
    }
  });

  /** The served model's id, from /v1/models: "ok", "unauthorized" (the key form is up) or "failed". */
  async function loadModel() {
    try {
      const res = await api("/v1/models");
      if (res.status === 401) return "unauthorized";
      if (!res.ok) return "failed";
      const id = (await res.json())?.data?.[0]?.id;
      if (typeof id === "string") {
        state.modelId = id;
        el.modelName.textContent = id;
      }
      return "ok";
    } catch {
      return "failed"; // unreachable: the banner says so
    }
  }

  // ---------------------------------------------------------------- settings

  const SETTING_INPUTS = { temperature: el.temperature, topP: el.topP, maxTokens: el.maxTokens, system: el.system };
  try {
    const saved = JSON.parse(local?.getItem(SETTINGS_STORE) || "{}");
    for (const [name, input] of Object.entries(SETTING_INPUTS)) {
      if (typeof saved[name] === "string") input.value = saved[name];
    }
  } catch {
    // a damaged entry: the defaults
  }
  for (const input of Object.values(SETTING_INPUTS)) {
    input.addEventListener("change", () => {
      const values = Object.fromEntries(Object.entries(SETTING_INPUTS).map(([n, i]) => [n, i.value]));
      keep(local, SETTINGS_STORE, JSON.stringify(values));
    });
  }

  /** A number field's value, or undefined (the server's default) when empty or out of range. */
  function numberField(input, ok) {
    const raw = input.value.trim();
    const x = Number(raw);
    return raw !== "" && Number.isFinite(x) && ok(x) ? x : undefined;
  }

  function sampling() {
    const out = {
      temperature: numberField(el.temperature, (x) => x >= 0 && x <= 2),
      top_p: numberField(el.topP, (x) => x > 0 && x <= 1),
      max_tokens: numberField(el.maxTokens, (x) => Number.isInteger(x) && x >= 1),
    };
    return Object.fromEntries(Object.entries(out).filter(([, v]) => v !== undefined));
  }

  // ---------------------------------------------------------------- messages

  function stickyScroll(change) {
    const m = el.messages;
    const atBottom = m.scrollHeight - m.scrollTop - m.clientHeight < 48;
    change();
    if (atBottom) m.scrollTop = m.scrollHeight; // follow the answer unless the reader scrolled up
  }

  function addUser(text) {
    const div = document.createElement("div");
    div.className = "msg user";
    div.textContent = text;
    stickyScroll(() => el.messages.append(div));
    return div;
  }

  /** The assistant's message: its text re-rendered at most once a frame while it streams. */
  function startReply() {
    const div = document.createElement("div");
    div.className = "msg assistant streaming";
    const body = document.createElement("div");
    body.className = "body";
    div.append(body);
    stickyScroll(() => el.messages.append(div));
    let text = "";
    let frame = 0;
    const render = () => {
      frame = 0;
      stickyScroll(() => body.replaceChildren(renderMarkdown(text)));
    };
    return {
      div,
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
        const p = document.createElement("p");
        p.className = "msg-error";
        p.textContent = message;
        stickyScroll(() => div.append(p));
      },
      stats(items) {
        const line = document.createElement("div");
        line.className = "stats";
        for (const [key, label] of items) {
          if (line.childNodes.length) line.append(" · "); // readable as text too, not only laid out
          const span = document.createElement("span");
          span.dataset.stat = key;
          span.textContent = label;
          line.append(span);
        }
        stickyScroll(() => div.append(line));
      },
    };
  }

  async function errorMessage(res) {
    try {
      const message = (await res.json())?.error?.message;
      if (typeof message === "string") return `Error ${res.status}: ${message}`;
    } catch {
      // not JSON
    }
    return `Error ${res.status} ${res.statusText}`.trim();
  }

  // ---------------------------------------------------------------- chat

  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
  }

  async function send() {
    const text = el.prompt.value;
    if (state.controller || !text.trim()) return;
    el.prompt.value = "";
    const chat = state.chat;
    const userTurn = { role: "user", content: text };
    const userDiv = addUser(text);
    const reply = startReply();
    const system = el.system.value.trim();
    const body = {
      messages: [...(system ? [{ role: "system", content: system }] : []), ...state.history, userTurn],
      stream: true,
      stream_options: { include_usage: true },
      ...sampling(),
    };
    if (state.modelId) body.model = state.modelId;
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    el.liveTokens.textContent = "0";
    const t0 = performance.now();
    let ttft = null;
    let pieces = 0;
    let colibri = null;
    let usage = null;
    let finish = null;
    let streamError = null;
    let queueMs = null;
    let stopped = false;
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (res.status === 401) { // asked for a key: the message waits for it, back in the box
        userDiv.remove();
        reply.div.remove();
        el.prompt.value = text;
        state.pendingSend = true;
        return;
      }
      if (!res.ok) {
        reply.fail(await errorMessage(res));
        userDiv.classList.add("failed");
        return;
      }
      const waited = Number(res.headers.get(QUEUE_WAIT_HEADER));
      queueMs = res.headers.has(QUEUE_WAIT_HEADER) && Number.isFinite(waited) ? waited : null;
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const { events, rest } = splitEvents(buffer + value);
        buffer = rest;
        for (const data of events) {
          if (data === "[DONE]") continue; // the stream ends right after it
          let chunk;
          try {
            chunk = JSON.parse(data);
          } catch {
            continue;
          }
          if (chunk.error) {
            streamError = chunk.error.message || "the generation failed";
            continue;
          }
          const choice = chunk.choices?.[0];
          const piece = choice?.delta?.content;
          if (piece) {
            if (ttft === null) ttft = performance.now() - t0;
            pieces += 1; // one SSE chunk per token the engine emits (usage corrects the count)
            el.liveTokens.textContent = String(pieces);
            reply.append(piece);
          }
          if (choice?.finish_reason) finish = choice.finish_reason;
          if (chunk.colibri) colibri = { ...colibri, ...chunk.colibri }; // finish chunk, then usage chunk
          if (chunk.usage) usage = chunk.usage;
        }
      }
    } catch (err) {
      if (err?.name === "AbortError") stopped = true;
      else streamError = "The server is unreachable or the connection broke.";
    } finally {
      if (state.controller === controller) {
        state.controller = null;
        setBusy(false);
      }
    }
    if (streamError) {
      reply.fail(streamError);
      userDiv.classList.add("failed");
      return;
    }
    if (stopped && !reply.text) {
      reply.fail("Stopped before the answer began.");
      userDiv.classList.add("failed");
      return;
    }
    reply.end();
    if (chat === state.chat) state.history.push(userTurn, { role: "assistant", content: reply.text });
    const stats = colibri?.stats;
    const completion = usage?.completion_tokens ?? stats?.emitted ?? pieces;
    const prompt = usage?.prompt_tokens ?? stats?.prompt_tokens;
    el.liveTokens.textContent = String(completion);
    const items = [];
    if (stopped) items.push(["stopped", "stopped"]);
    if (Number.isFinite(stats?.tok_s)) {
      items.push(["tok-s", `${fmtNum(stats.tok_s)} tok/s`]);
      if (!stopped) {
        state.tps = [...state.tps, stats.tok_s].slice(-TREND_TURNS);
        drawTrend();
      }
    } else if (!stopped) {
      items.push(["tok-s", "— tok/s"]); // a server without colibri's stats: the line keeps its shape
    }
    if (ttft !== null) items.push(["ttft", `TTFT ${fmtMs(ttft)}`]);
    if (prompt !== undefined) items.push(["prompt-tokens", `${prompt} prompt`]);
    items.push(["completion-tokens", `${completion} completion tokens`]);
    if (queueMs !== null) items.push(["queue-wait", `queue ${fmtMs(queueMs)}`]);
    const reused = colibri?.perf?.reused_tokens;
    if (reused) items.push(["reused-tokens", `${reused} reused from the KV cache`]);
    if (state.experts && Number.isFinite(stats?.hit_pct)) items.push(["hit-pct", `experts ${fmtNum(stats.hit_pct)}% in RAM`]);
    if (finish === "length") items.push(["length", "cut at max tokens"]);
    reply.stats(items);
  }

  function stop() {
    state.controller?.abort(); // the server sees the disconnect and cancels the request in the engine
  }

  // send() handles what a request can do wrong; anything else is a bug, logged, not swallowed whole
  const sendNow = () => send().catch((err) => console.error("colibri console:", err));
  el.composer.addEventListener("submit", (ev) => {
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
  el.newChat.addEventListener("click", () => {
    stop();
    state.chat += 1;
    state.history = [];
    el.messages.replaceChildren();
    el.liveTokens.textContent = "0";
    el.prompt.focus();
  });

  // ---------------------------------------------------------------- runtime panel

  function banner(message) {
    el.banner.textContent = message || "";
    el.banner.hidden = !message;
  }

  function setStatus(text, kind) {
    el.status.textContent = text;
    el.status.className = `pill ${kind}`;
  }

  function drawTrend() {
    const ns = "http://www.w3.org/2000/svg";
    const values = state.tps;
    el.tpsTrend.replaceChildren();
    if (!values.length) return;
    const max = Math.max(...values) || 1;
    const x = (k) => (values.length === 1 ? 100 : (k / (values.length - 1)) * 200);
    const line = document.createElementNS(ns, "polyline");
    const points = values.map((v, k) => `${x(k).toFixed(1)},${(38 - (v / max) * 34).toFixed(1)}`);
    const y0 = points[0].split(",")[1];
    line.setAttribute("points", values.length === 1 ? `0,${y0} 200,${y0}` : points.join(" ")); // one turn: a level line
    el.tpsTrend.append(line);
    const last = values[values.length - 1];
    el.tpsLast.textContent = `· last ${fmtNum(last)}, best ${fmtNum(max)}`;
    el.tpsTrend.setAttribute("aria-label", `decode speed of the last turns, tok/s: ${values.map((v) => fmtNum(v)).join(", ")}`);
  }

  // Hardware and block types are shown when the server reports them (HwInfo's field names).
  function showHardware(hw) {
    const none = "not reported";
    el.hwCpu.textContent = hw?.cpu_name || none;
    el.hwCores.textContent = hw?.cores ? String(hw.cores) : none;
    el.hwRam.textContent = Number.isFinite(hw?.ram_total_gb)
      ? `${fmtNum(hw.ram_total_gb)} GB` + (Number.isFinite(hw.ram_avail_gb) ? `, ${fmtNum(hw.ram_avail_gb)} GB free` : "")
      : none;
  }

  function showBlockTypes(types) {
    let text = "";
    if (Array.isArray(types)) text = types.join(", ");
    else if (types && typeof types === "object") {
      text = Object.entries(types).map(([k, v]) => `${k} ×${v}`).join(", ");
    } else if (typeof types === "string") text = types;
    for (const node of document.querySelectorAll('[data-row="block-types"]')) node.hidden = !text;
    el.blockTypes.textContent = text;
  }

  function showHealth(h) {
    if (!state.modelId && typeof h.model === "string") el.modelName.textContent = h.model;
    if (Number.isFinite(h.slots)) el.kvSlots.textContent = `${h.active ?? 0} / ${h.slots} in use`;
    if (Number.isFinite(h.queued)) el.queued.textContent = String(h.queued);
    if (Number.isFinite(h.engine_restarts)) el.restarts.textContent = String(h.engine_restarts);
    showHardware(h.hardware || h.hwinfo);
    showBlockTypes(h.block_types);
  }

  async function pollHealth() {
    let res;
    try {
      res = await fetch("/health", { cache: "no-store" });
    } catch {
      banner("The server is unreachable. Retrying…");
      setStatus("unreachable", "bad");
      return false;
    }
    const h = await res.json().catch(() => null);
    if (res.ok) {
      banner("");
      setStatus(h?.status || "ok", h?.status === "ok" ? "ok" : "");
      el.status.title = h?.status === "degraded" ? h.reason || "" : "GET /health";
    } else if (h?.status === "draining") {
      banner("The server is shutting down: requests in progress finish, new ones are refused.");
      setStatus("draining", "bad");
    } else if (res.status === 503 && h?.status) {
      banner(`The engine is restarting${h.reason ? ` (${h.reason})` : ""}. Answers resume when it is back.`);
      setStatus("restarting", "bad");
    } else {
      banner(`The server answered /health with ${res.status}. Retrying…`);
      setStatus(String(res.status), "bad");
    }
    if (h && typeof h === "object" && "slots" in h) showHealth(h);
    return true;
  }

  async function pollMetrics() {
    const res = await fetch("/metrics", { cache: "no-store" });
    if (!res.ok) return;
    const m = parseMetrics(await res.text());
    const prompt = m.get('colibri_tokens_total{kind="prompt"}') ?? 0;
    const completion = m.get('colibri_tokens_total{kind="completion"}') ?? 0;
    el.tokensServed.textContent = `${prompt} prompt · ${completion} generated`;
    const n = m.get("colibri_time_to_first_token_seconds_count");
    const sum = m.get("colibri_time_to_first_token_seconds_sum");
    el.tokensServed.title = n ? `mean time to first token after admission: ${fmtMs((sum / n) * 1000)}` : "";
  }

  async function pollExperts() {
    const res = await fetch("/experts", { cache: "no-store" });
    if (res.ok) showExperts(await res.json());
  }

  async function poll() {
    try {
      if (!document.hidden) { // a background tab does not poll
        if (await pollHealth()) {
          await Promise.allSettled([pollMetrics(), pollExperts()]);
          if (!state.modelId && el.keyForm.hidden) await loadModel(); // e.g. the page came up first
        }
      }
    } catch (err) {
      console.error("colibri console:", err); // a bug in showing the panel: polling goes on
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) pollHealth();
  });

  // ---------------------------------------------------------------- expert map

  const ctx = el.canvas.getContext("2d");
  const map = {
    rows: 0, cols: 0, seq: null, bytes: new Uint8Array(0), flash: new Float32Array(0),
    scale: 0, gap: 0, image: null, frame: 0, tip: null, // tip: the hovered or focused cell
  };

  function showExperts(e) {
    const t = e.tiers;
    const total = t ? (t.vram_experts || 0) + (t.ram_experts || 0) + (t.disk_experts || 0) : 0;
    el.expertTiers.textContent = total
      ? `${t.ram_experts} RAM · ${t.disk_experts} disk` + (t.vram_experts ? ` · ${t.vram_experts} VRAM` : "") +
        (Number.isFinite(e.hit_pct) ? ` · ${fmtNum(e.hit_pct)}% hits` : "")
      : "none";
    const rows = e.rows | 0;
    const cols = e.cols | 0;
    state.experts = total > 0;
    if (!rows || !cols) {
      // A dense model reports no experts at all; an MoE model before its first map has tiers
      el.noExperts.hidden = total > 0;
      el.expertsWait.hidden = !(total > 0);
      el.mapWrap.hidden = el.legend.hidden = true;
      map.rows = map.cols = 0;
      return;
    }
    el.noExperts.hidden = el.expertsWait.hidden = true;
    el.mapWrap.hidden = el.legend.hidden = false;
    const n = rows * cols;
    const bytes = hexBytes(e.map, n);
    if (rows !== map.rows || cols !== map.cols) {
      Object.assign(map, { rows, cols, seq: null, bytes, flash: new Float32Array(n), scale: 0 });
      layoutMap();
    }
    // New telemetry since the last poll: what was routed meanwhile flashes (HITS, or a heat that rose)
    if (map.seq !== null && e.seq !== map.seq) {
      const hits = hexBytes(e.hits, (n + 7) >> 3);
      for (let i = 0; i < n; i++) {
        if ((hits[i >> 3] >> (i & 7)) & 1 || (bytes[i] & HEAT_MAX) > (map.bytes[i] & HEAT_MAX)) map.flash[i] = 1;
      }
    }
    map.bytes = bytes;
    map.seq = e.seq;
    drawMap();
    animateFlash();
    if (map.tip) showTip(...map.tip);
  }

  /** Canvas pixels per cell: as many as fit the panel (device pixels, capped in height). */
  function layoutMap() {
    if (!map.rows) return;
    const dpr = window.devicePixelRatio || 1;
    const width = el.mapWrap.clientWidth || 300;
    const scale = Math.max(1, Math.min(32, Math.floor((width * dpr) / map.cols), Math.floor((MAP_MAX_HEIGHT * dpr) / map.rows)));
    if (scale === map.scale) return;
    map.scale = scale;
    map.gap = scale >= 6 ? Math.round(dpr) : 0; // a hairline between cells once they are big enough
    el.canvas.width = map.cols * scale;
    el.canvas.height = map.rows * scale;
    el.canvas.style.width = `${(map.cols * scale) / dpr}px`;
    map.image = ctx.createImageData(el.canvas.width, el.canvas.height);
  }

  // One ImageData for the whole map, one putImageData per frame: 94 x 256 cells stay cheap.
  function drawMap() {
    const { rows, cols, scale: s, gap, bytes, flash, image } = map;
    if (!rows || !image) return;
    const px = image.data;
    const stride = cols * s * 4;
    const side = s - gap;
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const i = r * cols + c;
        const base = TIER_RGB[bytes[i] >> 6] || TIER_RGB[0];
        const k = 0.18 + (0.82 * (bytes[i] & HEAT_MAX)) / HEAT_MAX; // brightness = heat; cold stays visible
        const f = flash[i];
        const red = base[0] * k * (1 - f) + 255 * f;
        const green = base[1] * k * (1 - f) + 255 * f;
        const blue = base[2] * k * (1 - f) + 255 * f;
        for (let y = 0; y < side; y++) {
          let o = (r * s + y) * stride + c * s * 4;
          for (let x = 0; x < side; x++, o += 4) {
            px[o] = red;
            px[o + 1] = green;
            px[o + 2] = blue;
            px[o + 3] = 255;
          }
        }
      }
    }
    ctx.putImageData(image, 0, 0);
  }

  function animateFlash() {
    if (map.frame || !map.flash.some((f) => f > 0)) return;
    const step = () => {
      let live = false;
      const flash = map.flash;
      for (let i = 0; i < flash.length; i++) {
        if (flash[i] > 0) {
          flash[i] = flash[i] < 0.02 ? 0 : flash[i] * FLASH_DECAY;
          live = true;
        }
      }
      drawMap();
      map.frame = live ? requestAnimationFrame(step) : 0;
    };
    map.frame = requestAnimationFrame(step);
  }

  /** The tooltip for cell (r, c), at (x, y) in the map's box. */
  function showTip(r, c, x, y) {
    if (r < 0 || c < 0 || r >= map.rows || c >= map.cols) return hideTip();
    map.tip = [r, c, x, y];
    const b = map.bytes[r * map.cols + c];
    el.tip.textContent =
      `MoE layer ${r} · expert ${c}\n${TIER_NAMES[b >> 6] || "unknown tier"} · heat ${b & HEAT_MAX}/${HEAT_MAX}` +
      (map.flash[r * map.cols + c] > 0.05 ? "\nrouted just now" : "") + atlasTip(r, c);
    el.tip.hidden = false;
    const box = el.mapWrap.clientWidth;
    const w = el.tip.offsetWidth;
    el.tip.style.left = `${Math.max(0, x + 14 + w > box ? x - 14 - w : x + 14)}px`;
    el.tip.style.top = `${y + 14}px`;
  }

  function hideTip() {
    map.tip = null;
    el.tip.hidden = true;
  }

  el.canvas.addEventListener("mousemove", (ev) => {
    const rect = el.canvas.getBoundingClientRect();
    const c = Math.floor(((ev.clientX - rect.left) / rect.width) * map.cols);
    const r = Math.floor(((ev.clientY - rect.top) / rect.height) * map.rows);
    showTip(r, c, ev.clientX - rect.left, ev.clientY - rect.top);
  });
  el.canvas.addEventListener("mouseleave", hideTip);
  el.canvas.addEventListener("blur", hideTip);

  // Keyboard: arrow keys move a cursor over the cells, with the same tooltip
  function tipAtCell(r, c) {
    const rect = el.canvas.getBoundingClientRect();
    showTip(r, c, ((c + 0.5) / map.cols) * rect.width, ((r + 0.5) / map.rows) * rect.height);
  }
  el.canvas.addEventListener("focus", () => map.rows && tipAtCell(0, 0));
  el.canvas.addEventListener("keydown", (ev) => {
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (!map.rows || !(ev.key in moves)) return;
    ev.preventDefault();
    const [r, c] = map.tip || [0, 0];
    const [dr, dc] = moves[ev.key];
    tipAtCell(Math.min(map.rows - 1, Math.max(0, r + dr)), Math.min(map.cols - 1, Math.max(0, c + dc)));
  });

  new ResizeObserver(() => {
    const before = map.scale;
    layoutMap();
    if (map.scale !== before) drawMap();
  }).observe(el.mapWrap);

  // ---------------------------------------------------------------- atlas

  let atlas = null; // the checked /atlas, or null while there is none

  /** /atlas's JSON (colibri/atlas.py), checked for the shapes the view reads; null if it is not one. */
  function checkAtlas(a) {
    if (!a || typeof a !== "object") return null;
    const rows = a.rows;
    const cols = a.cols;
    const topics = a.topics;
    if (!Number.isInteger(rows) || !Number.isInteger(cols) || rows < 1 || cols < 1) return null;
    if (!Array.isArray(topics) || !topics.length) return null;
    const grid = (g, ok) => Array.isArray(g) && g.length === rows &&
      g.every((row) => Array.isArray(row) && row.length === cols && row.every(ok));
    const num = (x) => typeof x === "number" && Number.isFinite(x);
    if (!grid(a.share, num) || !grid(a.dominant, Number.isInteger)) return null;
    if (!grid(a.affinity, (v) => Array.isArray(v) && v.length === topics.length && v.every(num))) return null;
    return { rows, cols, topics: topics.map(String), share: a.share, affinity: a.affinity, dominant: a.dominant };
  }

  const topicColor = (k) => (k >= 0 ? ATLAS_COLORS[k % ATLAS_COLORS.length] : ATLAS_UNUSED);

  async function pollAtlas() {
    if (document.hidden) return;
    let res;
    try {
      res = await fetch("/atlas", { cache: "no-store" });
    } catch {
      return; // unreachable: the banner says so; the last atlas stays
    }
    if (res.ok) {
      showAtlas(checkAtlas(await res.json().catch(() => null)));
    } else if (res.status === 404) {
      showAtlas(null);
    }
  }

  function showAtlas(a) {
    atlas = a;
    el.noAtlas.hidden = Boolean(a);
    el.atlasMap.hidden = el.atlasLegend.hidden = !a;
    el.atlasLegend.replaceChildren();
    if (!a) return;
    const item = (color, label) => {
      const li = document.createElement("li");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = color;
      li.append(sw, document.createTextNode(label));
      el.atlasLegend.append(li);
    };
    a.topics.forEach((t, k) => item(topicColor(k), t));
    item(ATLAS_UNUSED, "unused");
    drawAtlas();
    if (map.tip) showTip(...map.tip);
  }

  /** A fixed pseudo-random number in [-1, 1) for expert (r, c): its dot's jitter. */
  function jitter(r, c, salt) {
    let h = Math.imul(r + 1, 73856093) ^ Math.imul(c + 1, 19349663) ^ Math.imul(salt, 83492791);
    h = Math.imul(h ^ (h >>> 13), 1274126177);
    h ^= h >>> 16;
    return ((h >>> 0) / 4294967296) * 2 - 1;
  }

  /** Each expert a dot: placed by its affinity (every topic a direction on a circle), sized by its
   *  share of the routed tokens, coloured by its dominant topic. */
  function drawAtlas() {
    if (!atlas || el.atlasMap.hidden) return;
    const dpr = window.devicePixelRatio || 1;
    const side = Math.max(120, Math.min(ATLAS_MAX_SIDE, el.atlasMap.parentElement.clientWidth || 300));
    const px = Math.round(side * dpr);
    if (el.atlasMap.width !== px) {
      el.atlasMap.width = el.atlasMap.height = px;
      el.atlasMap.style.width = `${side}px`;
    }
    const g = el.atlasMap.getContext("2d");
    g.clearRect(0, 0, px, px);
    const { rows, cols, topics, share, affinity, dominant } = atlas;
    const dirs = topics.map((_, k) => {
      const angle = (2 * Math.PI * k) / topics.length - Math.PI / 2;
      return [Math.cos(angle), Math.sin(angle)];
    });
    const mid = px / 2;
    const reach = px * 0.36;
    g.font = `${Math.round(11 * dpr)}px system-ui, sans-serif`;
    g.textAlign = "center";
    g.textBaseline = "middle";
    dirs.forEach(([dx, dy], k) => { // each topic's corner, named
      g.fillStyle = topicColor(k);
      g.fillText(topics[k].slice(0, 24), mid + dx * reach * 1.25, mid + dy * reach * 1.25);
    });
    let maxShare = 0;
    for (const row of share) for (const x of row) maxShare = Math.max(maxShare, x);
    const spread = reach * 0.12;
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        let x = 0;
        let y = 0;
        affinity[r][c].forEach((w, k) => {
          x += w * dirs[k][0];
          y += w * dirs[k][1];
        });
        const radius = dpr * (1.5 + (maxShare > 0 ? 5 * Math.sqrt(Math.max(0, share[r][c]) / maxShare) : 0));
        g.beginPath();
        g.arc(mid + x * reach + jitter(r, c, 1) * spread, mid + y * reach + jitter(r, c, 2) * spread,
          radius, 0, 2 * Math.PI);
        g.fillStyle = topicColor(dominant[r][c] < topics.length ? dominant[r][c] : -1);
        g.globalAlpha = 0.8;
        g.fill();
        g.globalAlpha = 1;
      }
    }
  }

  /** The expert map's tooltip line for (r, c): its measured affinity, when the atlas fits the map. */
  function atlasTip(r, c) {
    if (!atlas || atlas.rows !== map.rows || atlas.cols !== map.cols) return "";
    const parts = atlas.affinity[r][c]
      .map((w, k) => [w, atlas.topics[k]])
      .filter(([w]) => w > 0.005)
      .sort((a, b) => b[0] - a[0])
      .slice(0, 4)
      .map(([w, t]) => `${t} ${w.toFixed(2)}`);
    return `\naffinity: ${parts.length ? parts.join(" · ") : "unused"}`;
  }

  new ResizeObserver(() => drawAtlas()).observe(el.atlasMap.parentElement);

  // ---------------------------------------------------------------- start

  loadModel();
  poll();
  pollAtlas();
  setInterval(pollAtlas, ATLAS_POLL_MS);
  el.prompt.focus();
}

// The runtime panel and the server's status: /health (the status pill, the banner, slots, queue,
// restarts, hardware, block types), /metrics (tokens served, mean TTFT), the model's name, and the
// trend of this page's last turns' decode speed.

import { getHealth, getMetrics } from "./api.js";
import { fmtMs, fmtNum } from "./format.js";

const TREND_TURNS = 30;
const SVG_NS = "http://www.w3.org/2000/svg"; // an XML namespace name, not a location: nothing is fetched
const $ = (id) => document.getElementById(id);
const tps = []; // tok/s of this page's last turns

/** Prometheus text as a Map of "name{labels}" to value. */
export function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    const m = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) out.set(m[1] + (m[2] || ""), Number(m[3]));
  }
  return out;
}

export function showModel(id) {
  $("model-name").textContent = id;
}

function banner(message) {
  const el = $("banner");
  el.textContent = message || "";
  el.hidden = !message;
}

function setStatus(text, kind, title = null) {
  const el = $("server-status");
  el.textContent = text;
  el.className = `pill ${kind}`;
  if (title !== null) el.title = title;
}

/** Poll /health once: false when the server is unreachable. ``modelKnown``: /v1/models has named
 *  the model (/health's name is shown only until then). */
export async function pollHealth(modelKnown) {
  let res;
  try {
    res = await getHealth();
  } catch {
    banner("The server is unreachable. Retrying…");
    setStatus("unreachable", "bad");
    return false;
  }
  const h = await res.json().catch(() => null);
  showStatus(res, h);
  if (h && typeof h === "object" && "slots" in h) showHealth(h, modelKnown);
  return true;
}

function showStatus(res, h) {
  if (res.ok) {
    banner("");
    const title = h?.status === "degraded" ? h.reason || "" : "GET /health";
    setStatus(h?.status || "ok", h?.status === "ok" ? "ok" : "", title);
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
}

function showHealth(h, modelKnown) {
  if (!modelKnown && typeof h.model === "string") showModel(h.model);
  if (Number.isFinite(h.slots)) $("kv-slots").textContent = `${h.active ?? 0} / ${h.slots} in use`;
  if (Number.isFinite(h.queued)) $("queued").textContent = String(h.queued);
  if (Number.isFinite(h.engine_restarts)) $("restarts").textContent = String(h.engine_restarts);
  showHardware(h.hardware || h.hwinfo);
  showBlockTypes(h.block_types);
}

// Hardware and block types are shown when the server reports them (HwInfo's field names).
function showHardware(hw) {
  const none = "not reported";
  $("hw-cpu").textContent = hw?.cpu_name || none;
  $("hw-cores").textContent = hw?.cores ? String(hw.cores) : none;
  const free = Number.isFinite(hw?.ram_avail_gb) ? `, ${fmtNum(hw.ram_avail_gb)} GB free` : "";
  $("hw-ram").textContent = Number.isFinite(hw?.ram_total_gb) ? `${fmtNum(hw.ram_total_gb)} GB${free}` : none;
}

function showBlockTypes(types) {
  let text = "";
  if (Array.isArray(types)) text = types.join(", ");
  else if (types && typeof types === "object") {
    text = Object.entries(types).map(([k, v]) => `${k} ×${v}`).join(", ");
  } else if (typeof types === "string") text = types;
  for (const node of document.querySelectorAll('[data-row="block-types"]')) node.hidden = !text;
  $("block-types").textContent = text;
}

/** Poll /metrics once: the tokens served, and the mean time to first token as the row's title. */
export async function pollMetrics() {
  const res = await getMetrics();
  if (!res.ok) return;
  const m = parseMetrics(await res.text());
  const prompt = m.get('colibri_tokens_total{kind="prompt"}') ?? 0;
  const completion = m.get('colibri_tokens_total{kind="completion"}') ?? 0;
  const el = $("tokens-served");
  el.textContent = `${prompt} prompt · ${completion} generated`;
  const n = m.get("colibri_time_to_first_token_seconds_count");
  const sum = m.get("colibri_time_to_first_token_seconds_sum");
  el.title = n ? `mean time to first token after admission: ${fmtMs((sum / n) * 1000)}` : "";
}

/** A finished turn's decode speed joins the trend. */
export function addSpeed(value) {
  tps.push(value);
  if (tps.length > TREND_TURNS) tps.shift();
  drawTrend();
}

function drawTrend() {
  const svg = $("tps-trend");
  svg.replaceChildren();
  if (!tps.length) return;
  const max = Math.max(...tps) || 1;
  const x = (k) => (tps.length === 1 ? 100 : (k / (tps.length - 1)) * 200);
  const points = tps.map((v, k) => `${x(k).toFixed(1)},${(38 - (v / max) * 34).toFixed(1)}`);
  const y0 = points[0].split(",")[1];
  const line = document.createElementNS(SVG_NS, "polyline");
  // one turn: a level line
  line.setAttribute("points", tps.length === 1 ? `0,${y0} 200,${y0}` : points.join(" "));
  svg.append(line);
  $("tps-last").textContent = `· last ${fmtNum(tps[tps.length - 1])}, best ${fmtNum(max)}`;
  const spoken = tps.map((v) => fmtNum(v)).join(", ");
  svg.setAttribute("aria-label", `decode speed of the last turns, tok/s: ${spoken}`);
}

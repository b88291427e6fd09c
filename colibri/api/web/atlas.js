// The atlas (/atlas, measured by `coli atlas`): each expert a dot, placed by the topics routed to
// it (every topic a direction on a circle), sized by its share of the routed tokens, coloured by
// its dominant topic. It also adds each expert's affinity to the expert map's tooltip.

import { getAtlas } from "./api.js";

const ATLAS_MAX_SIDE = 360; // CSS px
const ATLAS_UNUSED = "rgb(140, 140, 140)";
const ATLAS_COLORS = [
  "rgb(230, 85, 70)", "rgb(60, 130, 230)", "rgb(40, 175, 95)", "rgb(235, 160, 30)", "rgb(170, 90, 220)",
  "rgb(30, 180, 190)", "rgb(225, 90, 170)", "rgb(130, 160, 40)", "rgb(150, 100, 60)", "rgb(90, 90, 200)",
];

let atlas = null; // the checked /atlas, or null while there is none
let el = null;
let shown = () => {}; // told when the atlas changes

const topicColor = (k) => (k >= 0 ? ATLAS_COLORS[k % ATLAS_COLORS.length] : ATLAS_UNUSED);

/** Wire the view; ``onShown()`` runs whenever another atlas (or none) is shown. Returns
 *  ``{poll(), tip(r, c, rows, cols)}``. */
export function initAtlas(onShown) {
  const $ = (id) => document.getElementById(id);
  el = { none: $("no-atlas"), canvas: $("atlas-map"), legend: $("atlas-legend") };
  shown = onShown;
  new ResizeObserver(() => drawAtlas()).observe(el.canvas.parentElement);
  return { poll: pollAtlas, tip: atlasTip };
}

/** /atlas's JSON (colibri/atlas.py), checked for the shapes the view reads; null if it is not one. */
export function checkAtlas(a) {
  if (!a || typeof a !== "object") return null;
  const { rows, cols, topics } = a;
  if (!Number.isInteger(rows) || !Number.isInteger(cols) || rows < 1 || cols < 1) return null;
  if (!Array.isArray(topics) || !topics.length) return null;
  const grid = (g, ok) => Array.isArray(g) && g.length === rows &&
    g.every((row) => Array.isArray(row) && row.length === cols && row.every(ok));
  const num = (x) => typeof x === "number" && Number.isFinite(x);
  if (!grid(a.share, num) || !grid(a.dominant, Number.isInteger)) return null;
  if (!grid(a.affinity, (v) => Array.isArray(v) && v.length === topics.length && v.every(num))) return null;
  const { share, affinity, dominant } = a;
  return { rows, cols, topics: topics.map(String), share, affinity, dominant };
}

async function pollAtlas() {
  if (document.hidden) return;
  let res;
  try {
    res = await getAtlas();
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
  el.none.hidden = Boolean(a);
  el.canvas.hidden = el.legend.hidden = !a;
  el.legend.replaceChildren();
  if (a) {
    a.topics.forEach((t, k) => legendItem(topicColor(k), t));
    legendItem(ATLAS_UNUSED, "unused");
    drawAtlas();
  }
  shown();
}

function legendItem(color, label) {
  const li = document.createElement("li");
  const sw = document.createElement("span");
  sw.className = "swatch";
  sw.style.background = color;
  li.append(sw, document.createTextNode(label));
  el.legend.append(li);
}

/** A fixed pseudo-random number in [-1, 1) for expert (r, c): its dot's jitter. */
function jitter(r, c, salt) {
  let h = Math.imul(r + 1, 73856093) ^ Math.imul(c + 1, 19349663) ^ Math.imul(salt, 83492791);
  h = Math.imul(h ^ (h >>> 13), 1274126177);
  h ^= h >>> 16;
  return ((h >>> 0) / 4294967296) * 2 - 1;
}

/** The canvas sized to its panel (device pixels): its 2-D context, its side and its scale. */
function sizedCanvas() {
  const dpr = window.devicePixelRatio || 1;
  const side = Math.max(120, Math.min(ATLAS_MAX_SIDE, el.canvas.parentElement.clientWidth || 300));
  const px = Math.round(side * dpr);
  if (el.canvas.width !== px) {
    el.canvas.width = el.canvas.height = px;
    el.canvas.style.width = `${side}px`;
  }
  const g = el.canvas.getContext("2d");
  g.clearRect(0, 0, px, px);
  return { g, px, dpr };
}

function drawAtlas() {
  if (!atlas || el.canvas.hidden) return;
  const { g, px, dpr } = sizedCanvas();
  const dirs = atlas.topics.map((_, k) => {
    const angle = (2 * Math.PI * k) / atlas.topics.length - Math.PI / 2;
    return [Math.cos(angle), Math.sin(angle)];
  });
  const view = { g, dpr, dirs, mid: px / 2, reach: px * 0.36 };
  drawTopicNames(view);
  drawDots(view);
}

/** Each topic's corner, named. */
function drawTopicNames({ g, dpr, dirs, mid, reach }) {
  g.font = `${Math.round(11 * dpr)}px system-ui, sans-serif`;
  g.textAlign = "center";
  g.textBaseline = "middle";
  dirs.forEach(([dx, dy], k) => {
    g.fillStyle = topicColor(k);
    g.fillText(atlas.topics[k].slice(0, 24), mid + dx * reach * 1.25, mid + dy * reach * 1.25);
  });
}

function drawDots({ g, dpr, dirs, mid, reach }) {
  const { rows, cols, topics, share, affinity, dominant } = atlas;
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
function atlasTip(r, c, rows, cols) {
  if (!atlas || atlas.rows !== rows || atlas.cols !== cols) return "";
  const parts = atlas.affinity[r][c]
    .map((w, k) => [w, atlas.topics[k]])
    .filter(([w]) => w > 0.005)
    .sort((a, b) => b[0] - a[0])
    .slice(0, 4)
    .map(([w, t]) => `${t} ${w.toFixed(2)}`);
  return `\naffinity: ${parts.length ? parts.join(" · ") : "unused"}`;
}

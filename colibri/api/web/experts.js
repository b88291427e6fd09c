// The expert map (/experts): one cell per (MoE layer, expert), coloured by its tier, brighter the
// hotter, flashing white when routed since the last poll; a tooltip, by pointer or arrow keys,
// names the cell. One ImageData for the whole map, one putImageData a frame: 94 x 256 cells stay
// cheap.

import { fmtNum } from "./format.js";

const HEAT_MAX = 63; // EMAP: (tier << 6) | heat, heat 0..63 (docs/serve_protocol.md)
const TIER_NAMES = ["disk", "RAM", "VRAM"];
const TIER_RGB = [[70, 120, 230], [40, 190, 110], [200, 90, 230]]; // as the legend's swatches
const FLASH_DECAY = 0.94; // per frame: a routed expert fades back to its colour in about a second
const MAP_MAX_HEIGHT = 420; // CSS px: a 94-layer map stays on screen beside the chat
const MOVES = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };

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

const map = {
  rows: 0, cols: 0, seq: null, bytes: new Uint8Array(0), flash: new Float32Array(0),
  scale: 0, gap: 0, image: null, frame: 0, tip: null, // tip: the hovered or focused cell
  hasExperts: false, // the model reports expert tiers (a dense one none)
  tipExtra: (_r, _c, _rows, _cols) => "", // more of a cell's tooltip (the atlas's affinity)
};
let el = null;

/** Wire the map. ``tipExtra(r, c, rows, cols)``: more of a cell's tooltip. Returns what the rest of
 *  the page asks of it. */
export function initExpertMap(tipExtra) {
  const $ = (id) => document.getElementById(id);
  el = {
    tiers: $("expert-tiers"), none: $("no-experts"), wait: $("experts-wait"), wrap: $("map-wrap"),
    canvas: $("expert-map"), tip: $("expert-tip"), legend: $("expert-legend"),
  };
  map.tipExtra = tipExtra;
  bindPointer();
  bindKeys();
  new ResizeObserver(() => {
    const before = map.scale;
    layoutMap();
    if (map.scale !== before) drawMap();
  }).observe(el.wrap);
  return { show: showExperts, hasExperts: () => map.hasExperts, refreshTip };
}

/** Show one /experts answer: the tier counts, then the map (or why there is none). */
function showExperts(e) {
  const t = e.tiers;
  const total = t ? (t.vram_experts || 0) + (t.ram_experts || 0) + (t.disk_experts || 0) : 0;
  el.tiers.textContent = total ? tierLine(t, e.hit_pct) : "none";
  map.hasExperts = total > 0;
  const rows = e.rows | 0;
  const cols = e.cols | 0;
  if (!rows || !cols) {
    // A dense model reports no experts at all; an MoE model before its first map has tiers
    el.none.hidden = total > 0;
    el.wait.hidden = !(total > 0);
    el.wrap.hidden = el.legend.hidden = true;
    map.rows = map.cols = 0;
    return;
  }
  el.none.hidden = el.wait.hidden = true;
  el.wrap.hidden = el.legend.hidden = false;
  update(rows, cols, e);
  drawMap();
  animateFlash();
  refreshTip();
}

/** "N RAM · N disk · N VRAM · hits%": where the experts are, and how often a routed one was in RAM. */
function tierLine(t, hitPct) {
  const vram = t.vram_experts ? ` · ${t.vram_experts} VRAM` : "";
  const hits = Number.isFinite(hitPct) ? ` · ${fmtNum(hitPct)}% hits` : "";
  return `${t.ram_experts} RAM · ${t.disk_experts} disk${vram}${hits}`;
}

/** Take in a map of ``rows`` x ``cols``: what was routed since the last poll flashes (HITS, or a
 *  heat that rose). */
function update(rows, cols, e) {
  const n = rows * cols;
  const bytes = hexBytes(e.map, n);
  if (rows !== map.rows || cols !== map.cols) {
    Object.assign(map, { rows, cols, seq: null, bytes, flash: new Float32Array(n), scale: 0 });
    layoutMap();
  }
  if (map.seq !== null && e.seq !== map.seq) {
    const hits = hexBytes(e.hits, (n + 7) >> 3);
    for (let i = 0; i < n; i++) {
      const hit = (hits[i >> 3] >> (i & 7)) & 1;
      if (hit || (bytes[i] & HEAT_MAX) > (map.bytes[i] & HEAT_MAX)) map.flash[i] = 1;
    }
  }
  map.bytes = bytes;
  map.seq = e.seq;
}

/** Canvas pixels per cell: as many as fit the panel (device pixels, capped in height). */
function layoutMap() {
  if (!map.rows) return;
  const dpr = window.devicePixelRatio || 1;
  const width = el.wrap.clientWidth || 300;
  const fit = Math.min(Math.floor((width * dpr) / map.cols), Math.floor((MAP_MAX_HEIGHT * dpr) / map.rows));
  const scale = Math.max(1, Math.min(32, fit));
  if (scale === map.scale) return;
  map.scale = scale;
  map.gap = scale >= 6 ? Math.round(dpr) : 0; // a hairline between cells once they are big enough
  el.canvas.width = map.cols * scale;
  el.canvas.height = map.rows * scale;
  el.canvas.style.width = `${(map.cols * scale) / dpr}px`;
  map.image = el.canvas.getContext("2d").createImageData(el.canvas.width, el.canvas.height);
}

/** A cell's colour into ``rgb``: its tier's, as bright as its heat (cold stays visible), whitened by
 *  its flash. Written in place: the map draws ~24,000 cells a frame while it flashes. */
function cellColor(byte, flash, rgb) {
  const base = TIER_RGB[byte >> 6] || TIER_RGB[0];
  const k = 0.18 + (0.82 * (byte & HEAT_MAX)) / HEAT_MAX;
  for (let j = 0; j < 3; j++) rgb[j] = base[j] * k * (1 - flash) + 255 * flash;
}

function drawMap() {
  const { rows, cols, scale: s, gap, bytes, flash, image } = map;
  if (!rows || !image) return;
  const px = image.data;
  const stride = cols * s * 4;
  const side = s - gap;
  const rgb = new Float64Array(3); // full precision: the pixel array rounds once, as it stores
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      cellColor(bytes[r * cols + c], flash[r * cols + c], rgb);
      for (let y = 0; y < side; y++) {
        let o = (r * s + y) * stride + c * s * 4;
        for (let x = 0; x < side; x++, o += 4) {
          px[o] = rgb[0];
          px[o + 1] = rgb[1];
          px[o + 2] = rgb[2];
          px[o + 3] = 255;
        }
      }
    }
  }
  el.canvas.getContext("2d").putImageData(image, 0, 0);
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
  const tier = TIER_NAMES[b >> 6] || "unknown tier";
  el.tip.textContent = `MoE layer ${r} · expert ${c}\n${tier} · heat ${b & HEAT_MAX}/${HEAT_MAX}` +
    (map.flash[r * map.cols + c] > 0.05 ? "\nrouted just now" : "") + map.tipExtra(r, c, map.rows, map.cols);
  el.tip.hidden = false;
  const box = el.wrap.clientWidth;
  const w = el.tip.offsetWidth;
  el.tip.style.left = `${Math.max(0, x + 14 + w > box ? x - 14 - w : x + 14)}px`;
  el.tip.style.top = `${y + 14}px`;
}

function hideTip() {
  map.tip = null;
  el.tip.hidden = true;
}

/** The open tooltip written again: the map or what the tooltip adds changed under it. */
function refreshTip() {
  if (map.tip) showTip(...map.tip);
}

function bindPointer() {
  el.canvas.addEventListener("mousemove", (ev) => {
    const rect = el.canvas.getBoundingClientRect();
    const c = Math.floor(((ev.clientX - rect.left) / rect.width) * map.cols);
    const r = Math.floor(((ev.clientY - rect.top) / rect.height) * map.rows);
    showTip(r, c, ev.clientX - rect.left, ev.clientY - rect.top);
  });
  el.canvas.addEventListener("mouseleave", hideTip);
  el.canvas.addEventListener("blur", hideTip);
}

// Keyboard: arrow keys move a cursor over the cells, with the same tooltip
function tipAtCell(r, c) {
  const rect = el.canvas.getBoundingClientRect();
  showTip(r, c, ((c + 0.5) / map.cols) * rect.width, ((r + 0.5) / map.rows) * rect.height);
}

function bindKeys() {
  el.canvas.addEventListener("focus", () => map.rows && tipAtCell(0, 0));
  el.canvas.addEventListener("keydown", (ev) => {
    if (!map.rows || !(ev.key in MOVES)) return;
    ev.preventDefault();
    const [r, c] = map.tip || [0, 0];
    const [dr, dc] = MOVES[ev.key];
    tipAtCell(Math.min(map.rows - 1, Math.max(0, r + dr)), Math.min(map.cols - 1, Math.max(0, c + dc)));
  });
}

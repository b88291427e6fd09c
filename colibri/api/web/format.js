// How the console writes durations and rates: one format for the chat's stats and the panels.

/** A duration in milliseconds: "840 ms", "1.25 s", "12.5 s". */
export function fmtMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

/** A measured number, or a dash where there is none. */
export function fmtNum(x, digits = 1) {
  return Number.isFinite(x) ? x.toFixed(digits) : "—";
}

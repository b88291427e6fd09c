// The settings drawer: sampling and the system prompt, kept in localStorage across visits.

import { keep, storage } from "./storage.js";

const SETTINGS_STORE = "colibri.settings";

/** Restore the saved values, save every change; returns ``{sampling(), system()}``, what the
 *  next request sends. */
export function initSettings() {
  const $ = (id) => document.getElementById(id);
  const inputs = {
    temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"), system: $("system-prompt"),
  };
  const local = storage("localStorage");
  restore(inputs, local);
  for (const input of Object.values(inputs)) {
    input.addEventListener("change", () => {
      const values = Object.fromEntries(Object.entries(inputs).map(([n, i]) => [n, i.value]));
      keep(local, SETTINGS_STORE, JSON.stringify(values));
    });
  }
  return { sampling: () => sampling(inputs), system: () => inputs.system.value.trim() };
}

function restore(inputs, local) {
  try {
    const saved = JSON.parse(local?.getItem(SETTINGS_STORE) || "{}");
    for (const [name, input] of Object.entries(inputs)) {
      if (typeof saved[name] === "string") input.value = saved[name];
    }
  } catch {
    // a damaged entry: the defaults
  }
}

/** A number field's value, or undefined (the server's default) when empty or out of range. */
function numberField(input, ok) {
  const raw = input.value.trim();
  const x = Number(raw);
  return raw !== "" && Number.isFinite(x) && ok(x) ? x : undefined;
}

/** The request's sampling fields: only those set. */
function sampling(inputs) {
  const out = {
    temperature: numberField(inputs.temperature, (x) => x >= 0 && x <= 2),
    top_p: numberField(inputs.topP, (x) => x > 0 && x <= 1),
    max_tokens: numberField(inputs.maxTokens, (x) => Number.isInteger(x) && x >= 1),
  };
  return Object.fromEntries(Object.entries(out).filter(([, v]) => v !== undefined));
}

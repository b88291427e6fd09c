// Requests to the server that served the page (every URL a path: same origin, no other host),
// and the API key they carry. The key lives in sessionStorage, as long as the tab.

import { keep, storage } from "./storage.js";

const KEY_STORE = "colibri.apiKey";
const session = storage("sessionStorage");
const key = {
  value: session?.getItem(KEY_STORE) || "",
  refused: (_wrong) => {}, // told when the server asks for a key: see onKeyNeeded
};
let servedModel = null; // from /v1/models

/** ``handler(wrong)`` runs when the server answers 401 to the current key: ``wrong`` is true when a
 *  key was sent (and is now forgotten), false when none was. */
export function onKeyNeeded(handler) {
  key.refused = handler;
}

export function useKey(value) {
  key.value = value;
  keep(session, KEY_STORE, value);
}

/** The served model's id once /v1/models named it, else null. */
export function modelId() {
  return servedModel;
}

/** A request with the key, if there is one. */
async function request(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const sent = key.value;
  if (sent) headers.set("Authorization", `Bearer ${sent}`);
  const res = await fetch(path, { ...init, headers, cache: "no-store" });
  if (res.status === 401) refused(sent);
  return res;
}

/** A 401 to a request sent with key ``sent`` ("" for none). The answer to an older key (the user
 *  entered another while it was in flight, or a poll left before the first key) says nothing
 *  about the current one: it neither clears it nor reports it. */
function refused(sent) {
  if (sent !== key.value) return;
  if (sent) useKey(""); // the key was sent and refused: it is the wrong one
  key.refused(Boolean(sent));
}

/** The served model, from /v1/models: "ok", "unauthorized" (the key is asked for) or "failed". */
export async function loadModel() {
  try {
    const res = await request("/v1/models");
    if (res.status === 401) return "unauthorized";
    if (!res.ok) return "failed";
    const id = (await res.json())?.data?.[0]?.id;
    if (typeof id === "string") servedModel = id;
    return "ok";
  } catch {
    return "failed"; // unreachable: the banner says so
  }
}

/** POST a streamed chat completion; ``signal`` aborts it (the server then cancels the request). */
export function postChat(body, signal) {
  return request("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
}

// The server's own state needs no key.
const publicGet = (path) => fetch(path, { cache: "no-store" });
export const getHealth = () => publicGet("/health");
export const getMetrics = () => publicGet("/metrics");
export const getExperts = () => publicGet("/experts");
export const getAtlas = () => publicGet("/atlas");

/** An error response as one line for the reader: the API's message when it sent one. */
export async function errorMessage(res) {
  try {
    const message = (await res.json())?.error?.message;
    if (typeof message === "string") return `Error ${res.status}: ${message}`;
  } catch {
    // not JSON
  }
  return `Error ${res.status} ${res.statusText}`.trim();
}

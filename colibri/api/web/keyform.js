// The API key form: shown when the server asks for a key, checked against /v1/models, and then
// the waiting message goes out.

import { onKeyNeeded, useKey } from "./api.js";

const WRONG_KEY = "The server refused this API key (401 invalid_api_key). Check it and enter it again.";
const NO_ANSWER = "The key could not be checked: the server did not answer. Try again.";

/** Wire the form. ``check()`` asks the server with the key in use ("ok", "unauthorized" or
 *  "failed"); ``accepted()`` runs once a key is accepted. Returns ``isOpen()``. */
export function initKeyForm(check, accepted) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  const error = document.getElementById("key-error");
  const showError = (message) => {
    error.textContent = message;
    error.hidden = !message;
  };
  onKeyNeeded((wrong) => {
    if (wrong) showError(WRONG_KEY);
    if (form.hidden) {
      form.hidden = false;
      input.focus();
    }
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = input.value.trim();
    const problem = keyProblem(key);
    if (problem) return showError(problem);
    useKey(key);
    showError("");
    const answer = await check();
    if (answer === "failed") showError(NO_ANSWER);
    if (answer !== "ok") return;
    form.hidden = true;
    input.value = "";
    accepted();
  });
  return { isOpen: () => !form.hidden };
}

/** Why ``key`` cannot be sent, or "": a header value must be visible ASCII (fetch throws on
 *  anything else). */
function keyProblem(key) {
  if (/^[\x21-\x7e]+$/.test(key)) return "";
  return key ? "An API key is printable ASCII without spaces." : "Enter the server's API key.";
}

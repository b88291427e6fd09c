// The colibri web console: a same-origin client of the server that serves it (docs/api.md, "Web
// console"). ES modules as they are, no build step, nothing fetched from any other host: every
// URL is a path. This module wires the views together and keeps the polls going.
//
// Safety rule, for every module: text from outside the page (model output, error messages,
// anything in a response) enters the DOM only as text nodes or textContent, never as markup.

import { getExperts, loadModel, modelId } from "./api.js";
import { initAtlas } from "./atlas.js";
import { initChat } from "./chat.js";
import { initExpertMap } from "./experts.js";
import { initKeyForm } from "./keyform.js";
import { addSpeed, pollHealth, pollMetrics, showModel } from "./runtime.js";
import { initSettings } from "./settings.js";

const POLL_MS = 2000;
const ATLAS_POLL_MS = 30000; // /atlas changes only when `coli atlas` runs again

if (typeof document !== "undefined" && document.getElementById("messages")) main();

function main() {
  let atlas = null;
  const map = initExpertMap((r, c, rows, cols) => atlas.tip(r, c, rows, cols));
  atlas = initAtlas(() => map.refreshTip());
  const chat = initChat(initSettings(), map.hasExperts, addSpeed);
  const keyForm = initKeyForm(checkModel, () => chat.resume());
  const poll = async () => {
    try {
      if (!document.hidden) await pollOnce(map, keyForm); // a background tab does not poll
    } catch (err) {
      console.error("colibri console:", err); // a bug in showing the panel: polling goes on
    } finally {
      setTimeout(poll, POLL_MS);
    }
  };
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) pollHealth(modelId() !== null);
  });
  checkModel();
  poll();
  atlas.poll();
  setInterval(atlas.poll, ATLAS_POLL_MS);
  document.getElementById("prompt").focus();
}

/** Ask /v1/models for the served model (this also checks the key) and name it in the panel. */
async function checkModel() {
  const answer = await loadModel();
  if (modelId() !== null) showModel(modelId());
  return answer;
}

async function pollOnce(map, keyForm) {
  if (!(await pollHealth(modelId() !== null))) return;
  await Promise.allSettled([pollMetrics(), pollExperts(map)]);
  if (modelId() === null && !keyForm.isOpen()) await checkModel(); // e.g. the page came up first
}

async function pollExperts(map) {
  const res = await getExperts();
  if (res.ok) map.show(await res.json());
}

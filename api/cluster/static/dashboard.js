// The dashboard's entry point: the API key field, polling /v1/state, the event feed, and the
// panels that draw what they get.

import { api, apiKey, onAuthProblem, setApiKey } from "./api.js";
import { setupChat } from "./chat.js";
import { setNodes } from "./colors.js";
import { $, h } from "./dom.js";
import { EventFeed } from "./events.js";
import { renderInstances } from "./instances.js";
import { renderNodes } from "./nodes.js";
import { setupRequestForm } from "./request.js";
import { renderAdmission, renderTasks } from "./tasks.js";

const POLL_MS = 2000;
// Events after which the state is worth reading again at once, rather than at the next poll
// (heartbeats are not: every node sends one every few seconds, and the poll shows them).
const STATE_EVENTS = /^(Node|Instance|Placement|Runner|Task(Completed|Failed|Cancelled|Started)|Model)/;
// Between two reads asked for by events, so that a busy log does not become a busy loop.
const MIN_GAP_MS = 500;

let drawn = { instances: "", tasks: "" };
let refreshing = null;
let again = false;
let later = null; // the timer of the folded read

function banner(text, kind = "error") {
  const el = $("banner");
  if (!text) {
    el.hidden = true;
    return;
  }
  if (!el.hidden && el.dataset.text === text) return; // polling repeats it: keep the one shown
  el.dataset.text = text;
  const close = h("button", { type: "button", class: "small", "aria-label": "dismiss" }, "×");
  close.addEventListener("click", () => (el.hidden = true));
  el.className = `banner ${kind}`;
  el.replaceChildren(h("span", {}, text), close);
  el.hidden = false;
}

function setConnection(text, kind) {
  const el = $("conn");
  el.textContent = text;
  el.className = `pill ${kind}`;
}

// Reads /v1/state and redraws; calls that come while one runs are folded into one more, a
// little later.
function refresh() {
  if (refreshing) again = true;
  if (refreshing || later) return;
  refreshing = (async () => {
    try {
      // This API process's queues beside the cluster's state (an older API has none).
      const [state, admission] = await Promise.all([
        api("v1/state?tasks=8"),
        api("v1/admission").catch(() => null),
      ]);
      setConnection("connected", "good");
      draw(state);
      renderAdmission($("admission"), admission);
    } catch (err) {
      setConnection(err.status === 401 ? "needs API key" : "unreachable", "bad");
    } finally {
      refreshing = null;
      if (again) {
        again = false;
        later = setTimeout(() => {
          later = null;
          refresh();
        }, MIN_GAP_MS);
      }
    }
  })();
}

function draw(state) {
  setNodes((state.nodes || []).map((n) => n.node_id));
  $("nodes-count").textContent = String((state.nodes || []).length);
  renderNodes($("nodes"), state);
  // Instances and tasks change rarely: redrawn only when they did, so that a click on a
  // button is never lost to a redraw.
  const instances = JSON.stringify(state.instances);
  if (instances !== drawn.instances) {
    drawn.instances = instances;
    renderInstances($("instances"), state, { onChanged: refresh, onError: banner });
  }
  const tasks = JSON.stringify(state.tasks);
  if (tasks !== drawn.tasks) {
    drawn.tasks = tasks;
    renderTasks($("tasks"), state);
  }
}

// Fills the model pickers from GET /v1/models, keeping what was chosen.
async function loadModels(form) {
  let models;
  try {
    models = (await api("v1/models")).data.map((m) => m.id);
  } catch {
    return;
  }
  const values = models.length ? models : [""];
  let changed = false;
  for (const select of [$("chat-model"), $("req-model")]) {
    const current = [...select.options].map((o) => o.value);
    if (JSON.stringify(current) === JSON.stringify(values)) continue;
    const chosen = select.value;
    select.replaceChildren(...values.map((m) => h("option", { value: m }, m || "no model known yet")));
    if (models.includes(chosen)) select.value = chosen;
    changed = true;
  }
  if (changed) form.preview();
}

function main() {
  const form = setupRequestForm({ onChanged: refresh });
  setupChat();
  const feed = new EventFeed({
    onEvent: (type) => {
      if (STATE_EVENTS.test(type)) refresh();
      if (type === "ModelAdded" || type === "ModelRemoved") loadModels(form);
    },
    onStatus: (status) => {
      $("events-status").textContent = status;
      $("events-status").className = `pill ${status === "live" ? "good" : "busy"}`;
    },
  });

  const keyInput = $("api-key");
  keyInput.value = apiKey();
  onAuthProblem((message) => {
    banner(`${message}. Enter the API key above (it is kept in this browser only).`);
    keyInput.classList.add("invalid");
  });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setApiKey(keyInput.value.trim());
    keyInput.classList.remove("invalid");
    banner(null);
    drawn = { instances: "", tasks: "" };
    refresh();
    loadModels(form);
    feed.restart();
  });

  refresh();
  loadModels(form);
  feed.restart();
  // A hidden tab does not poll; it catches up when shown again.
  setInterval(() => document.hidden || refresh(), POLL_MS);
  setInterval(() => document.hidden || loadModels(form), 15000);
  document.addEventListener("visibilitychange", () => document.hidden || refresh());
}

main();

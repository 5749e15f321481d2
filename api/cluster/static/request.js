// Requesting an instance: the form shows the planner's placement preview
// (POST /v1/placement/preview) for what is filled in, and only then offers to submit it
// (POST /v1/instances).

import { api } from "./api.js";
import { $, bytes, h } from "./dom.js";
import { layerMap } from "./layers.js";

export function setupRequestForm({ onChanged }) {
  const form = $("request-form");
  const submit = $("req-submit");
  const result = $("req-result");
  let previewed = null; // the body the preview on screen is for
  let seq = 0;
  let timer = null;

  function body() {
    const data = new FormData(form);
    const b = { model: String(data.get("model") || "") };
    const replicas = Number(data.get("replicas"));
    if (replicas) b.replicas = replicas;
    const context = Number(data.get("context_length"));
    if (context) b.context_length = context;
    const placement = String(data.get("placement") || "").trim();
    if (placement) b.placement = placement;
    return b;
  }

  async function preview() {
    const b = body();
    const mine = ++seq;
    submit.disabled = true;
    if (!b.model) {
      result.replaceChildren(h("p", { class: "empty" }, "No model known yet."));
      return;
    }
    result.replaceChildren(h("p", { class: "empty" }, "Asking the planner…"));
    try {
      const p = await api("v1/placement/preview", { method: "POST", body: b });
      if (mine !== seq) return; // the form changed meanwhile
      previewed = JSON.stringify(b);
      submit.disabled = false;
      result.replaceChildren(previewView(p));
    } catch (err) {
      if (mine !== seq) return;
      previewed = null;
      result.replaceChildren(h("p", { class: "error-text" }, err.message));
    }
  }

  function schedule() {
    clearTimeout(timer);
    submit.disabled = true;
    timer = setTimeout(preview, 400);
  }

  form.addEventListener("input", schedule);
  form.addEventListener("change", schedule);
  $("req-preview").addEventListener("click", preview);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const b = body();
    if (JSON.stringify(b) !== previewed) return preview(); // preview what is sent first
    b.queue = form.elements.queue.checked;
    submit.disabled = true;
    try {
      const r = await api("v1/instances", { method: "POST", body: b });
      result.replaceChildren(h("p", { class: "ok-text" }, "Requested ", h("span", { class: "mono" }, r.id), "."));
      previewed = null;
      onChanged();
    } catch (err) {
      submit.disabled = false;
      result.replaceChildren(h("p", { class: "error-text" }, err.message));
    }
  });
  return { preview };
}

function previewView(p) {
  if (!p.placeable) {
    return h(
      "div",
      { class: "preview" },
      h("p", { class: "error-text" }, `Cannot be placed now: ${p.reason}`),
      h("p", { class: "hint" }, "Tick “queue” to request it anyway: the planner places it when room appears."),
    );
  }
  return h(
    "div",
    { class: "preview" },
    h("p", { class: "ok-text" }, `Placeable: ${bytes(p.need_bytes_per_replica)} per replica, context ${p.context_length}.`),
    layerMap(p.shards, { describe: (s) => ` · ${bytes(s.bytes)}` }),
    // Why each replica went where it did (one GPU, a node's GPUs, RAM...).
    ...(p.why || []).map((why, i) => h("p", { class: "hint" }, p.why.length > 1 ? `Replica ${i + 1}: ${why}` : why)),
  );
}

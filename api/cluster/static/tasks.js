// The most recent tasks (from /v1/state): what ran where, and how fast.

import { h, parseTime, pill, stateKind, clock } from "./dom.js";

export function renderTasks(container, state) {
  const tasks = state.tasks || [];
  if (!tasks.length) {
    container.replaceChildren(h("p", { class: "empty" }, "No task yet: send a chat."));
    return;
  }
  const head = h("tr", {}, ["when", "task", "model", "status", "tokens", "first token", "tokens/s"].map((t) => h("th", {}, t)));
  const rows = tasks.map((t) =>
    h(
      "tr",
      {},
      h("td", {}, clock(parseTime(t.created_at))),
      h("td", { class: "mono", title: t.task_id }, t.task_id.slice(0, 8)),
      h("td", {}, t.model_id),
      h("td", { title: t.error || "" }, pill(t.status, stateKind(t.status))),
      h("td", { class: "num" }, t.completion_tokens ?? ""),
      h("td", { class: "num" }, t.ttft_ms === null || t.ttft_ms === undefined ? "" : `${Math.round(t.ttft_ms)} ms`),
      h("td", { class: "num" }, t.tokens_per_s === null || t.tokens_per_s === undefined ? "" : t.tokens_per_s.toFixed(1)),
    ),
  );
  container.replaceChildren(h("table", { class: "tasks" }, h("thead", {}, head), h("tbody", {}, rows)));
}

// This API process's admission control (GET /v1/admission): per model, its slots in use, the
// requests waiting here for one, and those refused with a 429.
export function renderAdmission(container, admission) {
  const models = (admission && admission.models) || [];
  if (!models.length) {
    container.replaceChildren();
    return;
  }
  const lines = models.map((m) => {
    const facts = [
      `${m.in_flight}/${m.capacity} slots busy`,
      `${m.queued} queued (at most ${m.max_queued})`,
      m.queued ? `oldest waiting ${m.oldest_wait_s.toFixed(1)} s` : null,
      `mean wait ${m.mean_wait_s.toFixed(2)} s`,
      m.rejected ? `${m.rejected} refused (429)` : null,
    ].filter(Boolean);
    return h("p", { class: "sub" }, h("strong", {}, m.model), ` · ${facts.join(" · ")}`);
  });
  container.replaceChildren(...lines);
}

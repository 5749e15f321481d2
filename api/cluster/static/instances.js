// The instances: each drawn across the nodes that hold its layers, with its runners' states and
// a delete button.

import { api } from "./api.js";
import { bytes, h, pill, stateKind } from "./dom.js";
import { layerMap } from "./layers.js";

export function renderInstances(container, state, { onChanged, onError }) {
  const instances = state.instances || [];
  if (!instances.length) {
    container.replaceChildren(h("p", { class: "empty" }, "No instance. Request one below."));
    return;
  }
  container.replaceChildren(...instances.map((i) => instanceCard(i, onChanged, onError)));
}

function instanceCard(inst, onChanged, onError) {
  const shards = (inst.shards || []).filter((s) => s.state !== "Stopped" || inst.status === "deleting");
  const nodes = new Set(shards.map((s) => s.node_id));
  const facts = [
    inst.model_id,
    inst.replicas > 1 ? `${inst.replicas} replicas` : null,
    inst.context_length ? `context ${inst.context_length}` : null,
    nodes.size > 1 ? `split over ${nodes.size} nodes` : nodes.size === 1 ? "on one node" : null,
    inst.needed_bytes ? `needs ${bytes(inst.needed_bytes)}` : null,
  ].filter(Boolean);
  const remove = h("button", { class: "danger small", type: "button", title: "DELETE /v1/instances/{id}" }, "Delete");
  remove.addEventListener("click", async () => {
    if (!window.confirm(`Delete instance ${inst.instance_id}? Its runners stop.`)) return;
    remove.disabled = true;
    try {
      await api(`v1/instances/${encodeURIComponent(inst.instance_id)}`, { method: "DELETE" });
      onChanged();
    } catch (err) {
      remove.disabled = false;
      onError(`Could not delete ${inst.instance_id}: ${err.message}`);
    }
  });
  return h(
    "article",
    { class: "card instance", dataset: { instanceId: inst.instance_id } },
    h(
      "header",
      { class: "card-head" },
      h("span", { class: "mono instance-id" }, inst.instance_id),
      pill(inst.status, stateKind(inst.status)),
      h("span", { class: "spacer" }),
      inst.status === "deleting" ? null : remove,
    ),
    h("p", { class: "sub" }, facts.join(" · ")),
    inst.reason && inst.status !== "placed" ? h("p", { class: "error-text" }, inst.reason) : null,
    shards.length ? layerMap(shards) : h("p", { class: "empty" }, inst.status === "requested" ? "Waiting to be placed…" : "No runners."),
  );
}

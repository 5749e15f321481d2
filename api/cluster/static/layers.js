// Where a model's layers are: one bar per replica, its segments coloured by the node that
// holds them, and one line per shard. Used for instances and for placement previews.

import { nodeColor } from "./colors.js";
import { h, pill, stateKind } from "./dom.js";

// shards: runner rows (with state) or preview shards (with bytes); both have node_id, device,
// replica, rank, start_layer, end_layer (exclusive) and n_layers.
export function layerMap(shards, { describe } = {}) {
  const replicas = new Map();
  for (const s of shards) {
    if (!replicas.has(s.replica)) replicas.set(s.replica, []);
    replicas.get(s.replica).push(s);
  }
  const ordered = [...replicas.entries()].sort((a, b) => a[0] - b[0]);
  return h(
    "div",
    { class: "layer-map" },
    ordered.map(([replica, list]) => replicaBar(replica, list, ordered.length > 1, describe)),
  );
}

function replicaBar(replica, shards, named, describe) {
  shards.sort((a, b) => a.start_layer - b.start_layer || a.rank - b.rank);
  const n = Math.max(...shards.map((s) => s.n_layers || s.end_layer));
  const segments = [];
  let at = 0;
  for (const s of shards) {
    if (s.start_layer > at) segments.push(h("div", { class: "layer-seg gap", style: { "flex-grow": String(s.start_layer - at) } }));
    const count = Math.max(0, s.end_layer - s.start_layer);
    const range = `${s.start_layer}–${s.end_layer - 1}`;
    segments.push(
      h(
        "div",
        {
          class: "layer-seg",
          style: { "flex-grow": String(Math.max(count, 0.5)), background: nodeColor(s.node_id) },
          title: `layers ${range} (${count}) on ${s.node_id} / ${s.device}`,
          dataset: { nodeId: s.node_id, rank: String(s.rank) },
        },
        h("span", {}, range),
      ),
    );
    at = Math.max(at, s.end_layer);
  }
  if (n > at) segments.push(h("div", { class: "layer-seg gap", style: { "flex-grow": String(n - at) } }));
  return h(
    "div",
    { class: "replica" },
    named ? h("div", { class: "replica-name" }, `replica ${replica}`) : null,
    h("div", { class: "layer-track", role: "img", "aria-label": `${n} layers` }, segments),
    h("div", { class: "layer-axis" }, h("span", {}, "layer 0"), h("span", {}, `${n} layers`)),
    h("ul", { class: "shard-list" }, shards.map((s) => shardLine(s, describe))),
  );
}

function shardLine(s, describe) {
  const progress = s.progress !== null && s.progress !== undefined && ["Downloading", "Loading"].includes(s.state) ? ` ${Math.round(s.progress * 100)}%` : "";
  return h(
    "li",
    { class: "shard" },
    h("span", { class: "swatch", style: { background: nodeColor(s.node_id) } }),
    h(
      "span",
      { class: "shard-text" },
      `layers ${s.start_layer}–${s.end_layer - 1} on `,
      h("span", { class: "mono" }, `${s.node_id} / ${s.device}`),
      s.world_size > 1 ? ` · stage ${s.rank + 1} of ${s.world_size}` : "",
      // Within one runner, how its devices share the layers (a pipeline's stages say it above).
      s.tensor_split && s.world_size <= 1 ? ` · tensor split ${s.tensor_split.join(" : ")}` : "",
      s.devices && s.devices.length ? ` · ${s.devices.map((d) => `${d.device} ${d.layers}`).join(" + ")} layers` : "",
      describe ? describe(s) : "",
    ),
    s.state ? pill(`${s.state}${progress}`, stateKind(s.state)) : null,
    s.error ? h("span", { class: "error-text" }, s.error) : null,
  );
}

// The node cards: memory, CPU and GPU use from each node's latest ResourceProfiled, and the
// shards it holds.

import { nodeColor } from "./colors.js";
import { ago, bytes, h, meter, parseTime, percent, pill, stateKind } from "./dom.js";

export function renderNodes(container, state) {
  const nodes = state.nodes || [];
  if (!nodes.length) {
    container.replaceChildren(h("p", { class: "empty" }, "No node has joined yet. Start one with `shoal up` or `shoal join`."));
    return;
  }
  const shardsOf = new Map();
  for (const r of state.runners || []) {
    if (r.state === "Stopped") continue;
    if (!shardsOf.has(r.node_id)) shardsOf.set(r.node_id, []);
    shardsOf.get(r.node_id).push(r);
  }
  container.replaceChildren(...nodes.map((n) => nodeCard(n, shardsOf.get(n.node_id) || [])));
}

function nodeCard(n, shards) {
  const seen = parseTime(n.last_seen);
  // A node that missed three heartbeats is probably gone, before the planner says so.
  const stale = n.status === "online" && seen && n.heartbeat_s && Date.now() - seen.getTime() > 3000 * n.heartbeat_s;
  const used = n.ram_total - n.ram_available;
  const gpus = (n.devices || []).filter((d) => d.kind === "gpu");
  return h(
    "article",
    { class: `card node ${n.status !== "online" ? "offline" : ""}`, dataset: { nodeId: n.node_id } },
    h(
      "header",
      { class: "card-head" },
      h("span", { class: "swatch", style: { background: nodeColor(n.node_id) } }),
      h("span", { class: "node-id mono", title: "node id" }, n.node_id),
      pill(stale ? "no heartbeat" : n.status, stale ? "busy" : stateKind(n.status)),
    ),
    h(
      "p",
      { class: "sub", title: n.cpu_model || "" },
      [n.hostname, `${n.cpu_count} CPU${n.cpu_count === 1 ? "" : "s"}`, n.cpu_model].filter(Boolean).join(" · "),
    ),
    meter(
      "Memory",
      n.ram_total ? used / n.ram_total : 0,
      `${bytes(used)} / ${bytes(n.ram_total)}`,
      `${bytes(n.ram_available)} available; ${bytes(n.memory_offered)} offered to placement`,
    ),
    meter("CPU", (n.cpu_load || 0) / 100, percent(n.cpu_load || 0)),
    gpus.map((g) =>
      h(
        "div",
        { class: "gpu" },
        meter(`${g.device} memory`, g.memory_total ? g.memory_used / g.memory_total : 0, `${bytes(g.memory_used)} / ${bytes(g.memory_total)}`, g.name),
        g.utilisation === null || g.utilisation === undefined ? null : meter(`${g.device} use`, g.utilisation / 100, percent(g.utilisation), g.name),
      ),
    ),
    h(
      "p",
      { class: "foot" },
      h("span", {}, `offers ${bytes(n.memory_offered)}`),
      h("span", {}, `seen ${ago(seen)}`),
    ),
    shards.length
      ? h(
          "ul",
          { class: "node-shards" },
          shards.map((r) =>
            h(
              "li",
              {},
              h("span", { class: "mono" }, r.instance_id),
              ` layers ${r.start_layer}–${r.end_layer - 1} on ${r.device} `,
              pill(r.state, stateKind(r.state)),
            ),
          ),
        )
      : null,
  );
}

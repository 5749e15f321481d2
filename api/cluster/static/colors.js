// One colour per node, the same in the node cards, the layer bars and the previews.

const PALETTE = ["#6ea8fe", "#ffb86b", "#7bd88f", "#ff7a85", "#7fdbd4", "#f5d76e", "#c39bd3", "#ff9ecb"];
const assigned = new Map();

// Nodes in the order of /v1/state (sorted by id): stable colours while the cluster is stable.
export function setNodes(nodeIds) {
  for (const id of nodeIds) nodeColor(id);
}

export function nodeColor(nodeId) {
  if (!assigned.has(nodeId)) assigned.set(nodeId, PALETTE[assigned.size % PALETTE.length]);
  return assigned.get(nodeId);
}

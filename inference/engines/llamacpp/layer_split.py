"""A GGUF model's layers dealt out to pipeline stages: the first stage's stay local, each later
stage's go to its ggml RPC device."""

from __future__ import annotations

from typing import Any

from llama_cpp import LLAMA_SPLIT_MODE_LAYER

from events.records import ShardAssignment


def check_stages(head: ShardAssignment, peers: list[ShardAssignment]) -> list[ShardAssignment]:
    """The whole pipeline in rank order, checked: contiguous layers from 0 to the model's
    last, one stage per rank."""
    stages = sorted([head, *peers], key=lambda s: s.rank)
    if [s.rank for s in stages] != list(range(head.world_size)):
        ranks = ", ".join(str(s.rank) for s in stages)
        raise ValueError(f"a pipeline of {head.world_size} stages has ranks {ranks}")
    edge = 0
    for s in stages:
        if s.start_layer != edge or s.end_layer <= s.start_layer:
            raise ValueError(
                f"stage {s.rank} holds layers {s.start_layer}-{s.end_layer - 1}; layer {edge}"
                " was expected to start it"
            )
        edge = s.end_layer
    if edge != head.n_layers:
        raise ValueError(f"the stages hold layers 0-{edge - 1} of a model of {head.n_layers}")
    return stages


def rpc_offload(head: ShardAssignment, peers: list[ShardAssignment]) -> dict[str, Any]:
    """``Llama`` arguments that keep the head's layers local and put each later stage's on its
    RPC device (the devices registered in rank order).

    llama.cpp offloads the last ``n_gpu_layers`` of the model's layers plus its output layer,
    and deals them out to the devices in proportion to ``tensor_split``: with one weight per
    stage equal to its layer count (the output layer counted with the last stage), every
    stage gets exactly its layers."""
    stages = check_stages(head, peers)
    if stages[0] != head:
        raise ValueError("only the first stage loads the model")
    counts = [s.end_layer - s.start_layer for s in stages[1:]]
    counts[-1] += 1  # the output layer
    return {
        "n_gpu_layers": sum(counts),
        "tensor_split": [float(c) for c in counts],
        "split_mode": LLAMA_SPLIT_MODE_LAYER,
        # Off across stages, as llama-cpp-python has it: on (a whole model's default), a split
        # Gemma's greedy reply left one process's within 14 tokens; off, the two are equal.
        "flash_attn": False,
    }

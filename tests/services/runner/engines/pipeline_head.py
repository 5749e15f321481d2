"""Rank 0 of an MLX pipeline as its own process, for the tests: serves a script of tasks the
way the runner's TaskServer does (prompt_tokens, check_request, steps) and prints one JSON line
per task, then shuts the pipeline down.

    python -m tests.services.runner.engines.pipeline_head --model DIR --layers 0:2 \
        --n-layers 4 --hosts 127.0.0.1:5000,127.0.0.1:5001 --script '[{"task": {...}}, ...]'

A script entry is ``{"task": <TaskCreated JSON>, "cancel_after": N}`` (``cancel_after``
optional: the task is cancelled once N tokens were generated); the output line has the token
ids, the finish reason, the text and the generation time. ``{"task": ..., "abandon_after": N}``
takes N tokens and leaves the generation suspended; ``{"wait": true}`` waits for a line on
stdin. A broken pipeline ends the script: a line ``{"broken": ...}`` and exit status 3. With
``--hold``, after the script it waits until it is killed, without shutting the pipeline down.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bus.events import TaskCreated
from services.runner.engines.base import Engine
from services.runner.engines.mlx_pipeline import PipelineBroken, PipelineHead, PipelineShard
from services.runner.generation import check_request, steps


def run_task(engine: Engine, task: TaskCreated, cancel_after: int | None = None) -> dict[str, Any]:
    """Serve ``task`` as TaskServer does; cancelled once ``cancel_after`` tokens came."""
    prompt = engine.prompt_tokens(task)
    limit = check_request(len(prompt), task.params, engine.n_ctx)
    tokens: list[int] = []
    text = ""
    finish = None

    def cancelled() -> bool:
        return cancel_after is not None and len(tokens) >= cancel_after

    began = time.perf_counter()
    for step in steps(engine, prompt, task.params, limit, cancelled):
        if step.token_id is not None:
            tokens.append(step.token_id)
        text += step.text
        finish = step.finish_reason
    seconds = time.perf_counter() - began
    return {"tokens": tokens, "finish": finish, "text": text, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--n-layers", type=int, required=True)
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--script", required=True)
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    parser.add_argument("--hold", action="store_true", help="after the script, wait forever")
    args = parser.parse_args()
    start, _, end = args.layers.partition(":")
    hosts = tuple(args.hosts.split(","))
    shard = PipelineShard(0, len(hosts), int(start), int(end), args.n_layers, hosts)
    head = PipelineHead(args.model, shard, n_ctx=512, connect_timeout=args.connect_timeout)
    # Loaded in another thread, as the runner does (asyncio.to_thread), generated in this one.
    loader = threading.Thread(target=head.load)
    loader.start()
    loader.join()
    print(json.dumps({"ready": True}), flush=True)
    abandoned: list[Iterator[int]] = []
    try:
        for entry in json.loads(args.script):
            if entry.get("wait"):
                sys.stdin.readline()
                continue
            task = TaskCreated.model_validate(entry["task"])
            if "abandon_after" in entry:
                # Taken from, then left suspended (not closed) while the next task starts.
                tokens = head.generate(head.prompt_tokens(task), task.params)
                abandoned.append(tokens)
                taken = [next(tokens) for _ in range(entry["abandon_after"])]
                print(json.dumps({"tokens": taken, "abandoned": True}), flush=True)
                continue
            print(json.dumps(run_task(head, task, entry.get("cancel_after"))), flush=True)
    except PipelineBroken as exc:
        print(json.dumps({"broken": str(exc)}), flush=True)
        return 3
    if args.hold:
        print(json.dumps({"holding": True}), flush=True)
        threading.Event().wait()
    head.shutdown()
    print(json.dumps({"shutdown": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

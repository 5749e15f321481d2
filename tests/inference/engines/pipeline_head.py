"""Rank 0 of an MLX pipeline as its own process, for the tests: serves a script of tasks the
way the runner's TaskServer does (the prompt's tokens, check_request, steps) and prints one JSON
line per task, then shuts the pipeline down.

    python -m tests.inference.engines.pipeline_head --model DIR --layers 0:2 \
        --n-layers 4 --hosts 127.0.0.1:5000,127.0.0.1:5001 --script '[{"task": {...}}, ...]'

A script entry is ``{"task": <TaskCreated JSON>, "cancel_after": N, "grammar": {"gbnf": ...,
"triggers": [...]}}`` (``cancel_after`` optional: the task is cancelled once N tokens were
generated; ``grammar`` optional); the output line has the token ids, the finish reason, the
text, the log-probabilities (the task's ``logprobs``, ``echo``) and the generation time, or
``{"invalid": ...}`` for a task that failed. ``{"task": ..., "abandon_after": N}`` takes N
tokens and leaves the generation suspended (holding its slot) until the script's end;
``{"together": [entries]}`` serves its task entries at once, each on a thread of its own, none
past its first token before all have one, and prints their lines as one (``"together"``) with
the head's decoding ``passes`` so far; ``{"wait": true}`` waits for a line on stdin. A broken
pipeline ends the script: a line ``{"broken": ...}`` and exit status 3. With ``--hold``, after
the script it waits until it is killed, without shutting the pipeline down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from events.catalogue import TaskCreated
from inference.decoding import Decoding, PromptScores, Token
from inference.engines.base import Engine
from inference.engines.mlx.head import PipelineHead
from inference.engines.mlx.ring import PipelineBroken, PipelineShard
from inference.generation import ScoredPrompt, check_request, steps
from structured.reply import Grammar, InvalidRequest


def prompt_of(engine: Engine, task: TaskCreated) -> list[int]:
    if task.messages is not None:
        return engine.chat_tokens([m.model_dump(exclude_none=True) for m in task.messages], None)
    if task.prompt is None:
        raise InvalidRequest("a completion task needs a prompt")
    return engine.text_tokens(task.prompt)


def decoding_of(task: TaskCreated, grammar: Grammar | None = None) -> Decoding:
    return Decoding(task.params, grammar, task.logprobs, task.echo)


def token_id(item: Token | PromptScores) -> int:
    assert isinstance(item, Token)
    return item.id


def run_task(
    engine: Engine,
    task: TaskCreated,
    cancel_after: int | None = None,
    grammar: Grammar | None = None,
    on_token: Callable[[], None] = lambda: None,
    generated: Sequence[int] = (),
) -> dict[str, Any]:
    """Serve ``task`` as TaskServer does; cancelled once ``cancel_after`` tokens came.
    ``on_token`` is called after each token; ``generated``: the task is resumed after these."""
    prompt = prompt_of(engine, task)
    limit = check_request(len(prompt), task.params, engine.n_ctx, echo=task.echo)
    tokens: list[int] = []
    text = ""
    finish = None
    logprobs: list[Any] = []
    scored: list[Any] | None = None

    def cancelled() -> bool:
        return cancel_after is not None and len(tokens) >= cancel_after

    began = time.perf_counter()
    decoding = dataclasses.replace(decoding_of(task, grammar), generated=tuple(generated))
    for step in steps(engine, prompt, decoding, limit, cancelled):
        if isinstance(step, ScoredPrompt):
            scored = [t.model_dump(mode="json") for t in step.tokens]
            continue
        if step.token_id is not None:
            tokens.append(step.token_id)
            on_token()
        if step.logprob is not None:
            logprobs.append(step.logprob.model_dump(mode="json"))
        text += step.text
        finish = step.finish_reason
    seconds = time.perf_counter() - began
    out = {"tokens": tokens, "finish": finish, "text": text, "seconds": seconds}
    if task.logprobs is not None:
        out["logprobs"] = logprobs
    if scored is not None:
        out["prompt"] = scored
    return out


def grammar_of(entry: dict[str, Any]) -> Grammar | None:
    spec = entry.get("grammar")
    return Grammar(spec["gbnf"], tuple(spec.get("triggers", ()))) if spec else None


def serve_entry(
    engine: Engine, entry: dict[str, Any], on_token: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """A task entry's output line; a task that fails is ``{"invalid": ...}``."""
    task = TaskCreated.model_validate(entry["task"])
    try:
        return run_task(
            engine,
            task,
            entry.get("cancel_after"),
            grammar_of(entry),
            on_token,
            entry.get("generated", ()),
        )
    except InvalidRequest as exc:  # the task fails, the pipeline goes on
        return {"invalid": str(exc)}


def serve_together(engine: Engine, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every entry on its own thread, all in flight at once: none goes past its first token
    before each has had its first (or failed)."""
    barrier = threading.Barrier(len(entries))

    def run(entry: dict[str, Any]) -> dict[str, Any]:
        waited = False

        def first() -> None:
            nonlocal waited
            if not waited:
                waited = True
                barrier.wait(timeout=60)

        out = serve_entry(engine, entry, first)
        first()
        return out

    with ThreadPoolExecutor(len(entries)) as pool:
        return list(pool.map(run, entries))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--n-layers", type=int, required=True)
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--script", required=True)
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--hold", action="store_true", help="after the script, wait forever")
    args = parser.parse_args()
    start, _, end = args.layers.partition(":")
    hosts = tuple(args.hosts.split(","))
    shard = PipelineShard(0, len(hosts), int(start), int(end), args.n_layers, hosts)
    head = PipelineHead(
        args.model, shard, n_ctx=args.n_ctx, slots=args.slots, connect_timeout=args.connect_timeout
    )
    # Loaded in another thread, as the runner does (asyncio.to_thread), generated in this one.
    loader = threading.Thread(target=head.load)
    loader.start()
    loader.join()
    print(json.dumps({"ready": True}), flush=True)
    abandoned: list[Generator[Token | PromptScores]] = []
    try:
        for entry in json.loads(args.script):
            if entry.get("wait"):
                sys.stdin.readline()
                continue
            if "together" in entry:
                outs = serve_together(head, entry["together"])
                steps, widest = head.passes
                print(json.dumps({"together": outs, "passes": steps, "widest": widest}), flush=True)
                continue
            if "abandon_after" in entry:
                # Taken from, then left suspended (not closed) while the next tasks run.
                task = TaskCreated.model_validate(entry["task"])
                tokens = head.generate(prompt_of(head, task), decoding_of(task))
                assert isinstance(tokens, Generator)
                abandoned.append(tokens)
                taken = [token_id(next(tokens)) for _ in range(entry["abandon_after"])]
                print(json.dumps({"tokens": taken, "abandoned": True}), flush=True)
                continue
            print(json.dumps(serve_entry(head, entry)), flush=True)
    except PipelineBroken as exc:
        print(json.dumps({"broken": str(exc)}), flush=True)
        return 3
    for generation in abandoned:
        generation.close()
    if args.hold:
        print(json.dumps({"holding": True}), flush=True)
        threading.Event().wait()
    head.shutdown()
    print(json.dumps({"shutdown": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

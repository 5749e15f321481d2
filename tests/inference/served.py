"""What a runner should publish for a task, computed in the test process with the runner's own
path (``prepare``, ``steps``), and what it did publish, in one comparable shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from events.catalogue import ChunkGenerated, TaskCreated
from events.records import TokenLogprob, ToolCallDelta
from inference.engines.base import Engine
from inference.generation import Step, check_request, steps
from inference.job import prepare

# One chunk: token id, text, tool-call deltas, finish reason; and its logprob apart.
Served = tuple[int | None, str, tuple[ToolCallDelta, ...], str | None]


def expected(
    engine: Engine, task: TaskCreated, images: Mapping[str, bytes] | None = None
) -> tuple[list[Served], list[float | None]]:
    """``images``: the bytes of the task's images, by digest."""
    job = prepare(engine, task, images)
    limit = check_request(len(job.prompt), task.params, engine.n_ctx, echo=task.echo)
    out = [
        s
        for s in steps(engine, job.prompt, job.decoding, limit, lambda: False, job.reply)
        if isinstance(s, Step)
    ]
    return [(s.token_id, s.text, s.tool_calls, s.finish_reason) for s in out], [
        _value(s.logprob) for s in out
    ]


def published(chunks: list[ChunkGenerated]) -> tuple[list[Served], list[float | None]]:
    return [(c.token_id, c.text, tuple(c.tool_calls), c.finish_reason) for c in chunks], [
        _value(c.logprob) for c in chunks
    ]


def _value(logprob: TokenLogprob | None) -> float | None:
    return None if logprob is None else logprob.logprob


def close(a: list[float | None], b: list[float | None], tolerance: float = 1e-3) -> bool:
    """Log-probabilities computed in two processes (or split over stages) agree."""
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or y is None or abs(x - y) <= tolerance)
        for x, y in zip(a, b, strict=True)
    )


def calls_of(served: list[Served]) -> dict[int, dict[str, Any]]:
    """The tool calls the deltas make up, by index."""
    calls: dict[int, dict[str, Any]] = {}
    for _, _, deltas, _ in served:
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] = d.name or call["name"]
            call["arguments"] += d.arguments
    return calls

"""Ollama's API, answered: the objects and NDJSON lines Ollama's clients read, from a task's
chunks and outcome (``translate.py`` reads its requests). Pure: chunks in, dicts out."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from api.errors import ApiError
from api.reply import Reply
from api.serving import Output, ndjson
from api.task_stream import TaskStream
from events.catalogue import ChunkGenerated
from events.records import FinishReason, Timings, TokenLogprob, Usage


def embedded(
    model: str, vectors: list[list[float]], prompt_tokens: int, wall_s: float
) -> dict[str, Any]:
    """``/api/embed``'s answer: the vectors in the inputs' order, and what reading took."""
    return {
        "model": model,
        "embeddings": vectors,
        "total_duration": _ns(wall_s * 1000),
        "load_duration": 0,
        "prompt_eval_count": prompt_tokens,
    }


def created_at(now: float | None = None) -> str:
    """Ollama's timestamps: RFC 3339 in UTC."""
    at = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    return at.isoformat().replace("+00:00", "Z")


DONE_REASON: dict[FinishReason, str] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "stop",  # Ollama's word for a reply that ended with its calls
    "cancelled": "stop",
    "error": "stop",
}


def _ns(ms: float) -> int:
    return max(0, round(ms * 1_000_000))


def done_fields(
    finish: FinishReason | None, usage: Usage, timings: Timings | None, wall_s: float
) -> dict[str, Any]:
    """The last line's (or the whole answer's) ending and counts, Ollama's durations in
    nanoseconds: prompt evaluation is the runner's time to the first token (queueing in it),
    evaluation the rest of its time; the total is what the API waited. Nothing is loaded on
    request: load_duration is 0."""
    prompt_ms = timings.ttft_ms if timings else 0.0
    eval_ms = max(0.0, timings.total_ms - timings.ttft_ms) if timings else 0.0
    return {
        "done": True,
        "done_reason": DONE_REASON[finish] if finish else "stop",
        "total_duration": max(_ns(wall_s * 1000), _ns(prompt_ms + eval_ms)),
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": _ns(prompt_ms),
        "eval_count": usage.completion_tokens,
        "eval_duration": _ns(eval_ms),
    }


def loaded(
    model: str, chat: bool, now: float | None = None, reason: str = "load"
) -> dict[str, Any]:
    """The answer to an empty prompt (or no messages): Ollama's way to load a model (``load``),
    or with ``keep_alive: 0`` to unload it (``unload``)."""
    body: dict[str, Any] = {"model": model, "created_at": created_at(now)}
    body |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return body | {"done": True, "done_reason": reason}


def logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob or 0.0,
        "bytes": list(lp.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top
        ],
    }


def tool_calls(reply: Reply) -> list[dict[str, Any]]:
    """Ollama's calls: whole, with the arguments as an object. A call cut off by num_predict
    (done_reason "length") has arguments that are not JSON yet: it comes with ``{}``."""
    out = []
    for i, call in enumerate(reply.tool_calls()):
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except json.JSONDecodeError:
            arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
        out.append({"function": {"index": i, "name": call.name, "arguments": arguments}})
    return out


class OllamaOut(Output):
    """One task's answer as Ollama writes it: NDJSON lines (``done: false`` as tokens come,
    the calls once whole, then a ``done: true`` line with the counts), or one object. A
    thinking model's thinking (``thinking``: unless the request turned it off) is
    ``message.thinking`` (``/api/chat``) or ``thinking`` (``/api/generate``), as Ollama's."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, chat: bool, logprobs: bool, thinking: bool = True) -> None:
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.thinking = thinking
        self._stream: TaskStream | None = None

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at()}

    def _text(self, text: str, thought: str = "") -> dict[str, Any]:
        thinking = {"thinking": thought} if thought and self.thinking else {}
        if self.chat:
            return {"message": {"role": "assistant", "content": text} | thinking}
        return {"response": text} | thinking

    def opening(self, ts: TaskStream, index: int) -> str:
        self._stream = ts  # its outcome's timings, for the last line
        return ""

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        lines = []
        for c in group:
            thought = c.reasoning if self.thinking else ""
            if not c.text and not thought and not (self.logprobs and c.logprob):
                continue  # a call's pieces come whole, at the end
            line = self._head() | self._text(c.text, thought)
            if self.logprobs:
                line["logprobs"] = [logprob_entry(c.logprob)] if c.logprob else []
            lines.append(ndjson(line | {"done": False}))
        return "".join(lines)

    def closing(self, replies: list[Reply], usages: list[Usage]) -> str:
        calls = tool_calls(replies[0]) if self.chat else []
        head = ""
        if calls:
            message = {"role": "assistant", "content": "", "tool_calls": calls}
            head = ndjson(self._head() | {"message": message, "done": False})
        last = self._head() | self._text("") | self._done(replies[0], usages[0], self._stream)
        return head + ndjson(last)

    def failure(self, err: ApiError) -> str:
        return ndjson({"error": err.message})

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        reply = replies[0]
        body = self._head() | self._text(reply.text, reply.reasoning)
        if self.chat and (calls := tool_calls(reply)):
            body["message"]["tool_calls"] = calls
        if self.logprobs:
            body["logprobs"] = [logprob_entry(lp) for lp in reply.logprobs]
        return body | self._done(reply, usages[0], first)

    def _done(self, reply: Reply, usage: Usage, ts: TaskStream | None) -> dict[str, Any]:
        finished = ts.finished if ts is not None else None
        completed = finished.completed if finished is not None else None
        started = ts.started_at if ts is not None else None
        wall_s = time.monotonic() - started if started is not None else 0.0
        timings = completed.timings if completed is not None else None
        return done_fields(reply.finish_reason, usage, timings, wall_s)

"""OpenAI's response objects, made from a task's chunks: chat completions and text completions,
whole or as stream chunks, with tool calls, log-probabilities and a thinking model's thinking
(``reasoning_content``, as DeepSeek, vLLM and llama.cpp's server name it). Pure: chunks in,
dicts out.

A request with ``n`` choices is ``n`` tasks; each choice is made from its own task's chunks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.reply import Reply
from events.catalogue import ChunkGenerated
from events.records import FinishReason, TokenLogprob, ToolCallDelta, Usage

# A runner's finish reason in OpenAI's vocabulary.
FINISH: dict[FinishReason, str] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
    "error": "stop",
}


def finish(reply: Reply) -> str:
    return FINISH[reply.finish_reason] if reply.finish_reason else "stop"


def usage(usages: list[Usage]) -> dict[str, Any]:
    """Several choices share one prompt: it is counted once (its cached part as the first
    choice's runner had it). A thinking model's thinking is among the completion tokens, and
    counted apart too (``reasoning_tokens``)."""
    prompt = usages[0].prompt_tokens if usages else 0
    cached = usages[0].cached_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in usages)},
    }


class Shape:
    """The head every object of one response shares."""

    def __init__(self, response_id: str, model: str, chat: bool) -> None:
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def usage_chunk(self, usages: list[Usage]) -> dict[str, Any]:
        return self.head(self.chunk_object) | {"choices": [], "usage": usage(usages)}


# --- chat -----------------------------------------------------------------------------------


def _entry(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top
        ],
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [_entry(lp) for lp in entries], "refusal": None}


def tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's stream pieces of tool calls: the first of a call has its id, type and name."""
    out = []
    for d in deltas:
        piece: dict[str, Any] = {"index": d.index}
        function: dict[str, Any] = {"arguments": d.arguments}
        if d.id is not None:
            piece |= {"id": d.id, "type": "function"}
        if d.name is not None:
            function = {"name": d.name} | function
        out.append(piece | {"function": function})
    return out


def chat_chunk(
    shape: Shape,
    index: int,
    chunks: list[ChunkGenerated],
    role: bool,
    logprobs: bool,
    reasoning: bool = True,
) -> dict[str, Any] | None:
    """One stream chunk for chunks of choice ``index`` that arrived together (None when they
    hold nothing to send). The first chunk of a choice has the assistant's role. ``reasoning``:
    whether the thinking is shown."""
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    thought = "".join(c.reasoning for c in chunks) if reasoning else ""
    if thought:
        delta["reasoning_content"] = thought
    text = "".join(c.text for c in chunks)
    if text:
        delta["content"] = text
    calls = tool_call_deltas([d for c in chunks for d in c.tool_calls])
    if calls:
        delta["tool_calls"] = calls
    finish = next((FINISH[c.finish_reason] for c in chunks if c.finish_reason), None)
    entries = [c.logprob for c in chunks if c.logprob is not None]
    if not delta and finish is None and not entries:
        return None
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(entries) if logprobs and entries else None,
        "finish_reason": finish,
    }
    return shape.head("chat.completion.chunk") | {"choices": [choice]}


def chat_completion(
    shape: Shape, replies: list[Reply], usages: list[Usage], logprobs: bool, reasoning: bool = True
) -> dict[str, Any]:
    choices = []
    for i, r in enumerate(replies):
        message: dict[str, Any] = {"role": "assistant", "content": r.text, "refusal": None}
        if reasoning and r.reasoning:
            message["reasoning_content"] = r.reasoning
        if r.calls:
            message["content"] = r.text or None
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in r.tool_calls()
            ]
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(r.logprobs) if logprobs else None,
                "finish_reason": finish(r),
            }
        )
    return shape.head("chat.completion") | {"choices": choices, "usage": usage(usages)}


# --- text completions ----------------------------------------------------------------------


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, sent back before its text (``echo``): the prompt's text, and its
    tokens' scores when the request asked for log-probabilities."""

    text: str
    scores: list[TokenLogprob] | None = None


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy shape: parallel lists; each token's alternatives as a dict, the token
    itself among them (OpenAI's "up to logprobs + 1"); a prompt's first token has none."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for lp in entries:
        tokens.append(lp.token)
        logprobs.append(lp.logprob)
        if lp.logprob is None:
            tops.append(None)
        else:
            top = {t.token: t.logprob for t in lp.top}
            top.setdefault(lp.token, lp.logprob)
            tops.append(top)
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def completion_chunk(
    shape: Shape,
    index: int,
    text: str,
    entries: list[TokenLogprob] | None,
    offset: int,
    finish: str | None,
) -> dict[str, Any]:
    logprobs = completion_logprobs(entries, offset) if entries is not None else None
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return shape.head("text_completion") | {"choices": [choice]}


def completion(
    shape: Shape,
    replies: list[Reply],
    usages: list[Usage],
    logprobs: bool,
    echo: Echo | None,
    prompt_chars: int,
) -> dict[str, Any]:
    """``prompt_chars``: where the generated text starts in prompt + text, for its offsets."""
    choices = []
    for i, r in enumerate(replies):
        text = (echo.text if echo else "") + r.text
        entries = None
        if logprobs:
            entries = ((echo.scores or []) if echo else []) + r.logprobs
        start = 0 if echo else prompt_chars
        lp = completion_logprobs(entries, start) if entries is not None else None
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish(r)})
    return shape.head("text_completion") | {"choices": choices, "usage": usage(usages)}

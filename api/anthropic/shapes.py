"""Anthropic's message as a client reads it, made from a task's reply: its content blocks
(thinking, text, ``tool_use``), why it stopped and its usage. Pure: a reply in, dicts out; the
stream of named events that carries them is ``messages.MessagesOut``."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from api.reply import Reply
from events.records import FinishReason, Usage

_STOP_REASONS: dict[FinishReason, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "cancelled": "end_turn",
    "error": "end_turn",
}


def stop_reason(reply: Reply) -> str:
    if reply.finish_reason == "stop" and reply.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS[reply.finish_reason] if reply.finish_reason else "end_turn"


def stop_sequence(reply: Reply) -> str | None:
    return reply.stop_sequence if reply.finish_reason == "stop" else None


def usage(u: Usage | None) -> dict[str, int]:
    """Anthropic counts a prompt's cached part apart from its ``input_tokens``."""
    cached = u.cached_tokens if u else 0
    return {
        "input_tokens": u.prompt_tokens - cached if u else 0,
        "output_tokens": u.completion_tokens if u else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is; a call cut off by
    ``max_tokens`` (not JSON yet) has ``{}``, with ``stop_reason: max_tokens``."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def signature(thinking: str) -> str:
    """A thinking block's signature: Anthropic's is opaque, checked when the block comes back;
    Shoal's is a digest of the text, for clients that require one."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def thinking_block(thinking: str, shown: bool = True) -> dict[str, Any]:
    """A thinking block; not ``shown`` (``display: omitted``), its text is left out."""
    text = thinking if shown else ""
    return {"type": "thinking", "thinking": text, "signature": signature(thinking)}


def content(reply: Reply, thinking: bool = False, shown: bool = True) -> list[dict[str, Any]]:
    """The thinking block (``thinking``: when asked, and there was some; its text when
    ``shown``), the text block (left out when it is empty and there are calls), then a
    ``tool_use`` block per call."""
    calls = reply.tool_calls()
    blocks: list[dict[str, Any]] = []
    if thinking and reply.reasoning:
        blocks.append(thinking_block(reply.reasoning, shown))
    if reply.text or not calls:
        blocks.append({"type": "text", "text": reply.text})
    blocks += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
        for c in calls
    ]
    return blocks


def message(
    msg_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    reason: str | None,
    sequence: str | None,
    u: Usage | None,
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(u),
    }


def whole_message(
    msg_id: str, model: str, reply: Reply, u: Usage, thinking: bool = False, shown: bool = True
) -> dict[str, Any]:
    blocks = content(reply, thinking, shown)
    return message(msg_id, model, blocks, stop_reason(reply), stop_sequence(reply), u)

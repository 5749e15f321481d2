"""A thinking model's thinking, read apart from its answer, as the reply streams.

Models whose chat template knows ``<think>`` (DeepSeek-R1 and its distills, Qwen3, QwQ) write
their thinking between ``<think>`` and ``</think>``, then the answer. Where the thinking starts
depends on the prompt the template made (``thinking_start``):

- ``inside``: the generation prompt opened the thinking itself (R1's ends in ``<think>\\n``), so
  the reply starts in the thinking and the first ``</think>`` ends it;
- ``may_open``: the model may open it (Qwen3, QwQ): a reply that starts with ``<think>`` (after
  whitespace) thinks first, any other is all answer;
- ``none``: a template that knows no thinking, or a prompt that closed it already (Qwen3 with
  ``enable_thinking`` false ends in ``<think>\\n\\n</think>``).

``ThinkingReply`` wraps the format's own parser (tool calls, content): the thinking goes to
``Parsed.reasoning``, what follows ``</think>`` to the inner parser. Whitespace around the
thinking is dropped (the template's ``\\n`` after ``<think>`` and before ``</think>``, the blank
line before the answer). A reply cut off inside its thinking is all thinking. It reads one
character at a time, so where the pieces are cut does not change what comes out. Each piece
says whether it was the thinking, its tags included (``Parsed.thinking``): the runner feeds one
token's text at a time, and counts the usage's reasoning tokens so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from structured.reply import InvalidRequest, Parsed, ReplyParser
from structured.text_reader import WHITESPACE

ThinkingStart = Literal["inside", "may_open", "none"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The variable of a template that turns its thinking on and off (Qwen3's), as llama.cpp's
# server and vLLM pass it in ``chat_template_kwargs``.
SWITCH = "enable_thinking"
# Variables the renderers set themselves (llama-cpp-python's and Hugging Face's), which a
# task's chat_template_kwargs may not replace.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "chat_template",
        "tokenize",
    }
)


def thinks(chat_template: str | None) -> bool:
    """Whether a model with this chat template writes ``<think>`` blocks."""
    return bool(chat_template) and THINK_CLOSE in (chat_template or "")


def template_kwargs(
    chat_template: str | None, thinking: bool | None, given: Mapping[str, Any]
) -> dict[str, Any]:
    """The chat template's extra variables: the task's own, and its thinking switch where the
    template has one (what the task gave explicitly wins). Raises ``InvalidRequest`` for a
    variable the renderer sets itself."""
    if reserved := sorted(RESERVED_KWARGS.intersection(given)):
        raise InvalidRequest(
            f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it itself"
        )
    kwargs: dict[str, Any] = {}
    if thinking is not None and chat_template and SWITCH in chat_template:
        kwargs[SWITCH] = thinking
    return kwargs | dict(given)


def thinking_start(chat_template: str | None, prompt_end: str) -> ThinkingStart:
    """Where the reply starts, from the end of the prompt the template made."""
    if not thinks(chat_template):
        return "none"
    end = prompt_end.rstrip(WHITESPACE)
    if end.endswith(THINK_OPEN):
        return "inside"
    if end.endswith(THINK_CLOSE):
        return "none"
    return "may_open"


def thinking_reply(inner: ReplyParser, start: ThinkingStart) -> ReplyParser:
    """``inner`` with the thinking read apart, where the reply may have some."""
    return inner if start == "none" else ThinkingReply(inner, start)


_State = Literal["lead", "thinking", "gap", "answer"]


class ThinkingReply:
    """A ``ReplyParser``: thinking to ``reasoning``, the rest to ``inner``."""

    def __init__(self, inner: ReplyParser, start: ThinkingStart) -> None:
        self._inner = inner
        self._state: _State = "thinking" if start == "inside" else "lead"
        self._held = ""  # read but not yet given out: a marker's start, whitespace
        self._thought = False  # whether any thinking was given out yet
        self._reasoning: list[str] = []
        self._answer: list[str] = []

    @property
    def called(self) -> bool:
        return self._inner.called

    @property
    def markers(self) -> frozenset[str]:
        return self._inner.markers | {THINK_OPEN, THINK_CLOSE}

    def feed(self, text: str) -> Parsed:
        before = self._state
        for i, char in enumerate(text):
            if self._state == "answer":
                self._answer.append(text[i:])
                break
            self._read(char)
        # The text was the thinking, or the tag that opened or closed it.
        thinking = "thinking" in (before, self._state)
        return self._take(self._inner.feed(self._flush_answer()), thinking)

    def finish(self) -> Parsed:
        if self._state == "lead":
            self._answer.append(self._held)  # no thinking after all: it is the answer's
        elif self._state == "thinking":
            self._think(self._held.rstrip(WHITESPACE))
        self._held = ""
        parsed = self._inner.feed(self._flush_answer())
        rest = self._inner.finish()
        ended = parsed.ended or rest.ended
        return self._take(Parsed(parsed.text + rest.text, parsed.calls + rest.calls, ended=ended))

    def _read(self, char: str) -> None:
        if self._state == "lead":
            self._held += char
            begun = self._held.lstrip(WHITESPACE)
            if begun == THINK_OPEN:
                self._state, self._held = "thinking", ""
            elif not THINK_OPEN.startswith(begun):
                self._state = "answer"
                self._answer.append(self._held)
                self._held = ""
        elif self._state == "thinking":
            self._held += char
            if self._held.endswith(THINK_CLOSE):
                self._think(self._held[: -len(THINK_CLOSE)].rstrip(WHITESPACE))
                self._state, self._held = "gap", ""
                return
            # Held back: what may start the closing tag, and the whitespace before it (which
            # is dropped if the thinking ends there).
            keep = _tag_start(self._held)
            while keep > 0 and self._held[keep - 1] in WHITESPACE:
                keep -= 1
            self._think(self._held[:keep])
            self._held = self._held[keep:]
        elif char not in WHITESPACE:  # the gap: whitespace before the answer is dropped
            self._state = "answer"
            self._answer.append(char)

    def _think(self, text: str) -> None:
        if not self._thought:
            text = text.lstrip(WHITESPACE)
        if text:
            self._reasoning.append(text)
            self._thought = True

    def _flush_answer(self) -> str:
        text = "".join(self._answer)
        self._answer.clear()
        return text

    def _take(self, inner: Parsed, thinking: bool = False) -> Parsed:
        reasoning = "".join(self._reasoning)
        self._reasoning.clear()
        return Parsed(
            inner.text, inner.calls, reasoning, inner.ended, thinking, self._state == "thinking"
        )


def _tag_start(held: str) -> int:
    """Where the longest end of ``held`` that could start ``</think>`` begins (len: none)."""
    for start in range(max(0, len(held) - len(THINK_CLOSE) + 1), len(held)):
        if THINK_CLOSE.startswith(held[start:]):
            return start
    return len(held)

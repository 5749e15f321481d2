"""From a token source to chunks: the part of serving a task that every engine shares.

An engine gives token ids and their bytes; this turns them into ``Step``s, one per generated
token, with text that is valid UTF-8, stop strings applied, and the finish reason on a last
step. It checks for cancellation between tokens, so a cancel stops generation within one token.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from bus.events import FinishReason, SamplingParams
from services.runner.stops import StopMatcher


class TokenSource(Protocol):
    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Token ids after ``prompt``, sampled as ``params`` say, until the caller stops."""
        ...

    def piece(self, token: int) -> bytes: ...

    def is_end(self, token: int) -> bool:
        """End of generation (EOS, end of turn)."""
        ...


@dataclass(frozen=True)
class Step:
    """One chunk: a generated token (``token_id`` set) or the final marker (``finish_reason``
    set, ``token_id`` None, carrying any text that was held back)."""

    idx: int
    text: str
    token_id: int | None
    finish_reason: FinishReason | None = None


class InvalidRequest(ValueError):
    """The task cannot be served as asked; the message says why, for TaskFailed."""


def check_request(prompt_tokens: int, params: SamplingParams, n_ctx: int) -> int:
    """Validate a request against the model; returns how many tokens may be generated."""
    if params.max_tokens is not None and params.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}")
    if not 0.0 <= params.temperature <= 2.0:
        raise InvalidRequest(f"temperature must be between 0 and 2, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"{name} must be between -2 and 2, got {value}")
    if prompt_tokens >= n_ctx:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens, more than the model's context of "
            f"{n_ctx} tokens leaves room for"
        )
    room = n_ctx - prompt_tokens
    return min(room, params.max_tokens) if params.max_tokens is not None else room


def steps(
    source: TokenSource,
    prompt: list[int],
    params: SamplingParams,
    limit: int,
    cancelled: Callable[[], bool],
) -> Iterator[Step]:
    """Generate at most ``limit`` tokens. Every token gives a Step; the last Step has the
    finish reason: "stop" (end token or stop string), "length" (limit), "cancelled"."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    matcher = StopMatcher(params.stop)
    idx = 0
    finish: FinishReason = "length"
    if limit > 0:
        for token in source.generate(prompt, params):
            if cancelled():
                finish = "cancelled"
                break
            if source.is_end(token):
                finish = "stop"
                break
            out = matcher.feed(decoder.decode(source.piece(token)))
            yield Step(idx, out.text, token)
            idx += 1
            if out.stopped:
                yield Step(idx, "", None, "stop")
                return
            if idx >= limit:
                break
            if cancelled():
                finish = "cancelled"
                break
    tail = "" if finish == "cancelled" else matcher.feed(decoder.decode(b"", final=True)).text
    held = "" if finish == "cancelled" else matcher.flush()
    yield Step(idx, tail + held, None, finish)

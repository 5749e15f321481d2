"""What an engine is asked for, beyond the prompt, and what it gives back: the vocabulary that
every engine (llama.cpp, MLX, a pipeline's head) and the shared serving code speak.

The engine samples token ids as ``Decoding`` says (sampling parameters, a grammar the output
must match, how many log-probabilities to report) and yields ``Token``s; the shared code
(``generation.py``) turns them into text, stops, tool calls and chunks.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from events.records import SamplingParams
from inference.image_spans import ImageSpan
from structured.reply import Grammar

# OpenAI's bounds: chat's top_logprobs goes to 20 (completions' logprobs to 5).
MAX_TOP_LOGPROBS = 20
# What a log-probability of minus infinity is reported as: JSON has no infinity.
LOGPROB_FLOOR = -9999.0


def floored(logprob: float) -> float:
    """A log-probability as reported: at least ``LOGPROB_FLOOR`` (minus infinity and NaN too)."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def request_seed(params: SamplingParams) -> int:
    """The request's seed, or a random one (64 bits) when it gives none."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8))


@dataclass(frozen=True)
class ThinkingBudget:
    """How many tokens a thinking model may think (``TaskCreated.thinking_budget``), and the
    tokens that end its thinking (``\\n</think>\\n\\n`` in the model's vocabulary), which the
    engine is made to generate once the budget is spent (``ForcedTokens``)."""

    tokens: int
    close: tuple[int, ...]


class ForcedTokens:
    """Token ids an engine generates next instead of sampling them: a thinking budget's closing
    tag. The ``Stepper`` puts them (it reads the reply), the engine takes one at each of its
    sample points (``next``) and accepts it into its sampler as if picked (penalties, the
    grammar). The two may be on different threads: a deque's ends are thread-safe.

    An engine that samples ahead of its consumer (MLX's ``BatchGenerator`` computes the next
    token before the last is handed over, and a batch decoder runs up to ``LOOKAHEAD`` tokens
    ahead) takes the first forced token that much later: the thinking is then a few tokens
    over its budget."""

    def __init__(self) -> None:
        self._queue: deque[int] = deque()

    def put(self, tokens: Sequence[int]) -> None:
        self._queue.extend(tokens)

    def next(self) -> int | None:
        """The token to generate next instead of sampling; None: sample."""
        try:
            return self._queue.popleft()
        except IndexError:
            return None

    def clear(self) -> None:
        self._queue.clear()


@dataclass(frozen=True)
class Decoding:
    """How to pick a task's tokens."""

    params: SamplingParams
    grammar: Grammar | None = None
    # None: no log-probabilities. k: each token's own, and its k most likely alternatives.
    top_logprobs: int | None = None
    # Score the prompt first: a ``PromptScores`` before the first token.
    echo: bool = False
    # A resumed task's tokens generated before: the engine's prompt ends with them, and its
    # sampler takes them as its own (penalties, the grammar) before it picks the next one.
    generated: tuple[int, ...] = ()
    # Whether the task was told to stop (its client left, another runner has it): asked by the
    # engine between a prompt's prefill chunks, where no token is made that a consumer could
    # stop taking, so that a long prompt stops within one chunk rather than at its end.
    cancelled: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    # A thinking model's budget: once spent inside the thinking, the closing tag is forced.
    thinking_budget: ThinkingBudget | None = None
    # What the engine generates next instead of sampling (shared by every copy of this
    # ``Decoding``: the ``Stepper`` puts, the engine takes).
    forced: ForcedTokens = field(default_factory=ForcedTokens, compare=False, repr=False)
    # The prompt's images (``image_spans.py``): the engine evaluates each apart from the text.
    images: tuple[ImageSpan, ...] = ()

    def stop_asked(self) -> bool:
        return self.cancelled is not None and self.cancelled()


@dataclass(frozen=True)
class Token:
    """A generated token id; with ``Decoding.top_logprobs`` set, its log-probability and the
    alternatives'. Log-probabilities are the model's own: log-softmax of the raw logits, before
    penalties, biases, the grammar and the temperature (what evaluation harnesses need), and
    never below ``LOGPROB_FLOOR``."""

    id: int
    logprob: float | None = None
    # (token id, log-probability), most likely first, ``top_logprobs`` of them.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptScores:
    """Each prompt token with its log-probability given the tokens before it, and the most
    likely alternatives there; the first token has none (``logprob`` None, ``top`` empty)."""

    tokens: tuple[Token, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class PromptCached:
    """How many of the prompt's first tokens the engine's cache held already (not computed
    again): before the first token, from an engine that keeps caches between generations."""

    tokens: int


class Sink(Protocol):
    """Where an engine that decodes on a thread of its own (a batch decoder) hands one
    generation's items, on that thread."""

    def take(self, item: Token | PromptScores | PromptCached) -> bool:
        """One item; False: no more are wanted (the generation ends, and its slot is free)."""
        ...

    def done(self, error: BaseException | None) -> None:
        """The generation ended: the engine's end (an end token, ``max_tokens``, the context
        full), a ``take`` that said False, or ``error``. Called once."""
        ...

    def ready(self) -> bool:
        """Whether the next token may be decoded now (a consumer pulling at its own pace has
        taken the last one)."""
        ...

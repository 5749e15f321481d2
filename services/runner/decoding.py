"""What an engine is asked for, beyond the prompt, and what it gives back: the vocabulary that
every engine (llama.cpp, MLX, a pipeline's head) and the shared serving code speak.

The engine samples token ids as ``Decoding`` says (sampling parameters, a grammar the output
must match, how many log-probabilities to report) and yields ``Token``s; the shared code
(``generation.py``) turns them into text, stops, tool calls and chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.events import SamplingParams

# OpenAI's bounds: chat's top_logprobs goes to 20 (completions' logprobs to 5).
MAX_TOP_LOGPROBS = 20
# What a log-probability of minus infinity is reported as: JSON has no infinity.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar (llama.cpp's dialect, root rule ``root``) the output must match.

    With ``triggers`` the grammar is lazy, as llama.cpp's ``grammar_lazy_patterns``: the model
    writes freely until the text generated so far matches one of these regular expressions
    (searched for anywhere; a pattern written ``^...$`` must match the whole text). From then
    on the grammar holds, applied to the text from the start of the pattern's first capture
    group that matched something (the whole match if none did), and once it is complete the
    only token allowed is an end of generation."""

    gbnf: str
    triggers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decoding:
    """How to pick a task's tokens."""

    params: SamplingParams
    grammar: Grammar | None = None
    # None: no log-probabilities. k: each token's own, and its k most likely alternatives.
    top_logprobs: int | None = None
    # Score the prompt first: a ``PromptScores`` before the first token.
    echo: bool = False


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

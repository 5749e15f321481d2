"""Picking the next token for the MLX engines (one process, each sequence of a batch, or a
pipeline's last rank) as a task's ``Decoding`` says: sampling parameters, a grammar,
log-probabilities.

Grammars are llama.cpp's GBNF, followed with llguidance: the GBNF is converted to llguidance's
Lark dialect (``gbnf_to_lark``), compiled once per grammar text for the model's vocabulary and
copied per task; at each step its token mask is applied to the logits here (llguidance's own
MLX helper is a Metal kernel, which the CPU build lacks). Lazy grammars (``Grammar.triggers``)
follow llama.cpp's ``grammar_lazy_patterns``: the generated text is searched with the patterns
after every token, and from the first match the grammar is fed the text from there and holds.

The vocabulary llguidance sees is llama.cpp's grammar view of it: every token's bytes, special
tokens included with their text (llama.cpp matches grammar literals against
``token_to_piece(special=true)``), the end tokens as end of sequence only (allowed once the
grammar may end, and then the only tokens allowed once it must).
"""

from __future__ import annotations

import functools
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np
import numpy.typing as npt
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from events.records import SamplingParams
from inference.decoding import Decoding, Token, floored
from inference.generation import check_against_vocabulary
from structured.reply import Grammar, InvalidRequest, Trigger

# Compiled grammars kept per vocabulary: a task's tools or schema make its grammar, and a
# client tends to send the same ones again.
GRAMMAR_CACHE_SIZE = 32
# Penalties count every generated token (mlx-lm's processors look at a window of this many).
_ALL = 2**31 - 1

# mlx-lm's logits processor: (tokens generated so far, logits) -> logits.
Processor = Callable[[mx.array, mx.array], mx.array]


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _lark(gbnf: str) -> str:
    """The GBNF as llguidance's grammar definition, checked (without a vocabulary: cheap);
    raises ``InvalidRequest`` when it is not valid GBNF or llguidance cannot take it."""
    try:
        lark = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(flatten_repetitions(gbnf)))
    except Exception as exc:  # the converter (llguidance's own, in Python) raises plain ones
        raise InvalidRequest(f"the grammar is not valid GBNF: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(lark)
    if error:
        raise InvalidRequest(f"the grammar is not valid: {error}")
    return lark


# llama-cpp-python's JSON-schema converter writes "at most n" as n nested optionals,
# "(x (x (x)?)?)?" (and with a separator, '("," x ("," x)?)?'): llguidance's Lark parser
# refuses a terminal nested about 30 deep (a string's maxLength of 30), so they become the
# same repetition in GBNF's own "{0,n}". String literals and character classes are matched
# first, whole, so that nothing inside one is taken for such a nest.
_LITERAL = r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]'
_NESTED = re.compile(
    rf"(?P<literal>{_LITERAL})"
    rf"|\((?P<x>(?:{_LITERAL}|[^\"\[\]()])+?) (?P<more>(?:\((?P=x) )*)"
    r"\((?P=x)\)(?:\?|\{0,(?P<k>\d+)\})(?P<closes>(?:\)\?)+)"
)


def flatten_repetitions(gbnf: str) -> str:
    """``gbnf`` with its nested optionals written as bounded repetitions (see above)."""

    def flat(match: re.Match[str]) -> str:
        if match["literal"] is not None:
            return match[0]
        x, k = match["x"], int(match["k"] or 1)
        opens, closes = 1 + match["more"].count(f"({x} "), len(match["closes"]) // 2
        n = min(opens, closes)  # the levels that close here
        return f"({x} " * (opens - n) + f"({x}){{0,{k + n}}}" + ")?" * (closes - n)

    return _NESTED.sub(flat, gbnf)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _trigger(pattern: str) -> Trigger:
    try:
        return Trigger(pattern)
    except re.error as exc:
        raise InvalidRequest(f"the grammar's trigger {pattern!r} is not a regex: {exc}") from exc


def check_decoding(decoding: Decoding, n_vocab: int) -> None:
    """What an engine can refuse before it computes anything (the ranges of the sampling
    parameters are ``check_request``'s): raises ``InvalidRequest``."""
    check_against_vocabulary(decoding.params, n_vocab, decoding.top_logprobs)
    if decoding.grammar is not None:
        check_grammar(decoding.grammar)


def check_grammar(grammar: Grammar) -> None:
    """The grammar and its triggers are valid."""
    _lark(grammar.gbnf)
    for pattern in grammar.triggers:
        _trigger(pattern)


class _Vocabulary:
    """llguidance's view of the vocabulary (see the module's docstring); what
    ``llguidance.TokenizerWrapper`` asks for."""

    def __init__(self, pieces: list[bytes], ends: list[int], encode: Callable[[str], list[int]]):
        self.tokens = pieces
        self.eos_token_id = ends[0] if ends else None
        self.bos_token_id = None
        self.special_token_ids = ends
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance asks whether bytes do; they do not
            raise TypeError("text only")
        return self._encode(text)


class Grammars:
    """Grammars compiled for one vocabulary, by grammar text. ``pieces``: each token's bytes as
    a grammar sees them (special tokens with their text); ``ends``: end-of-generation tokens;
    ``n_vocab``: the width of the model's logits."""

    def __init__(
        self,
        pieces: Sequence[bytes],
        ends: Sequence[int],
        n_vocab: int,
        encode: Callable[[str], list[int]],
    ) -> None:
        padded = list(pieces[:n_vocab]) + [b""] * (n_vocab - len(pieces))
        self.pieces = padded
        self.n_vocab = n_vocab
        vocabulary = _Vocabulary(padded, sorted(ends), encode)
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocabulary), n_vocab=n_vocab, eos_token=sorted(ends)
        )
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def constraint(self, grammar: Grammar) -> Constraint:
        """A task's own state of ``grammar`` (compiled at its first use, then copied)."""
        matcher = self._compiled.get(grammar.gbnf)
        if matcher is None:
            matcher = llguidance.LLMatcher(self.tokenizer, _lark(grammar.gbnf), log_level=0)
            if matcher.is_error():
                raise InvalidRequest(f"the grammar is not valid: {matcher.get_error()}")
            self._compiled[grammar.gbnf] = matcher
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar.gbnf)
        triggers = tuple(_trigger(p) for p in grammar.triggers)
        return Constraint(matcher.deep_copy(), triggers, self)


class Constraint:
    """One task's grammar: which tokens it allows next, and the tokens picked."""

    def __init__(
        self, matcher: llguidance.LLMatcher, triggers: tuple[Trigger, ...], of: Grammars
    ) -> None:
        self._matcher = matcher
        self._triggers = triggers
        self._grammars = of
        self._waiting = bool(triggers)
        self._text = b""  # generated so far, while waiting for a trigger
        self._bitmask = allocate_token_bitmask(1, of.n_vocab)

    def allowed(self) -> npt.NDArray[np.bool_] | None:
        """The tokens the grammar allows next, as a mask over the vocabulary; None while it
        waits for its trigger."""
        if self._waiting:
            return None
        fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():  # e.g. a grammar too ambiguous for llguidance's limits
            raise InvalidRequest(f"the grammar cannot be followed: {self._matcher.get_error()}")
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        mask: npt.NDArray[np.bool_] = bits[: self._grammars.n_vocab].astype(np.bool_)
        return mask

    def accept(self, token: int) -> None:
        if not self._waiting:
            if not self._matcher.consume_token(token):
                raise InvalidRequest(
                    f"the grammar refused token {token}: {self._matcher.get_error()}"
                )
            return
        self._text += self._grammars.pieces[token]
        # The first pattern that matches, as llama.cpp tries them.
        start = next((s for t in self._triggers if (s := t.start(self._text)) is not None), None)
        if start is None:
            return
        # As llama.cpp: the grammar holds from the trigger on, and is fed the text from there,
        # which may begin or end inside a token (as bytes: tokens that spell them).
        self._waiting = False
        rest, self._text = self._text[start:], b""
        tokens = self._grammars.tokenizer.tokenize_bytes(rest)
        if self._grammars.tokenizer.decode_bytes(tokens) != rest or not (
            self._matcher.consume_tokens(tokens)
        ):
            raise InvalidRequest(
                f"the text that triggered the grammar does not fit it: {rest!r} "
                f"({self._matcher.get_error()})"
            )


class Picker:
    """Picks a task's tokens from the last position's logits, in llama.cpp's order: logit bias,
    penalties over the generated tokens (repeat_penalty multiplicative as llama.cpp's, presence
    and frequency additive as OpenAI's), the grammar, then greedy at temperature 0, else top_k,
    top_p, min_p and a draw at the temperature, with the task's own random key (the same seed
    gives the same tokens). The filters and penalties are mlx-lm's own; greedy without bias,
    penalty or grammar is mlx-lm's ``generate_step`` exactly. With ``top_logprobs``, each token
    comes with log-probabilities of the raw logits."""

    def __init__(
        self,
        decoding: Decoding,
        seed: int,
        n_vocab: int,
        grammars: Callable[[], Grammars] | None = None,
    ) -> None:
        check_decoding(decoding, n_vocab)
        params = decoding.params
        self._params = params
        self._n_vocab = n_vocab
        self._top_logprobs = decoding.top_logprobs
        self._key = mx.random.key(seed % 2**64)
        self._generated: list[int] = []
        self._processors = penalty_processors(params)
        self._constraint: Constraint | None = None
        if decoding.grammar is not None:
            if grammars is None:
                raise InvalidRequest("this engine cannot follow a grammar")
            self._constraint = grammars().constraint(decoding.grammar)
        # Taken instead of a pick (a thinking budget's closing tag): the engine's own Stepper
        # puts them, or a pipeline's last rank from what rank 0 sends.
        self.forced = decoding.forced
        self.take_generated(decoding.generated)

    def take_generated(self, tokens: Sequence[int]) -> None:
        """Tokens generated before (a resumed task), as if picked: the penalties count them
        and the grammar goes on after them."""
        for token in tokens:
            self._generated.append(token)
            if self._constraint is not None:
                self._constraint.accept(token)

    def pick(self, logits: mx.array) -> Token:
        """``logits``: the last position's, shape (1, vocab). A forced token (``forced``) is
        taken instead of a pick, unless the grammar refuses it (then none more is forced)."""
        forced = self.forced.next()
        allowed = self._constraint.allowed() if self._constraint is not None else None
        if forced is not None and (allowed is None or bool(allowed[forced])):
            choice = mx.array([forced], dtype=mx.uint32)
        else:
            if forced is not None:
                self.forced.clear()
            choice = self._draw(logits, allowed)
        if self._top_logprobs is None:
            token = int(np.array(choice)[0])
            picked = Token(token)
        else:
            ids, lps = _scores(logits, choice, self._top_logprobs)
            picked = as_tokens(ids, lps)[0]
            token = picked.id
        self._generated.append(token)
        if self._constraint is not None:
            self._constraint.accept(token)
        return picked

    def _draw(self, logits: mx.array, allowed: npt.NDArray[np.bool_] | None) -> mx.array:
        params = self._params
        x = logits
        if self._processors:
            # In float32: mlx-lm's processors update their input in place.
            x = logits.astype(mx.float32)
            tokens = mx.array(self._generated, dtype=mx.int32)
            for processor in self._processors:
                x = processor(tokens, x)
        if allowed is not None:
            x = mx.where(mx.array(allowed), x, -math.inf)
        # Log-probabilities in the logits' dtype, as mlx-lm's samplers take them.
        logprobs = x - mx.logsumexp(x, keepdims=True)
        key = None
        if params.temperature != 0:
            self._key, key = mx.random.split(self._key)
        return draw(logprobs, params, self._n_vocab, key)


def penalty_processors(params: SamplingParams) -> list[Processor]:
    """mlx-lm's processors for the logit bias and the penalties (``processor(generated, logits)``
    with the tokens generated so far; in float32: they update their input in place)."""
    processors: list[Processor] = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repeat_penalty if params.repeat_penalty != 1.0 else None,
        repetition_context_size=_ALL,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=_ALL,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=_ALL,
    )
    return processors


def draw(
    logprobs: mx.array, params: SamplingParams, n_vocab: int, key: mx.array | None
) -> mx.array:
    """The token picked from ``logprobs`` (rows, vocab; processed, masked): greedy at
    temperature 0 (``key`` unused), else top_k, top_p, min_p and a draw at the temperature with
    ``key``. One id per row."""
    if params.temperature == 0:
        return mx.argmax(logprobs, axis=-1)
    assert key is not None
    logprobs = logprobs.astype(mx.float32)
    if 0 < params.top_k < n_vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    if params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    return mx.random.categorical(logprobs * (1 / params.temperature), axis=-1, key=key)


def scored(logits: mx.array, token: int, k: int) -> Token:
    """``token`` picked from ``logits`` (1, vocab; the raw ones), with its log-probability and
    the ``k`` most likely tokens'."""
    return as_tokens(*_scores(logits, mx.array([token], dtype=mx.int32), k))[0]


def _scores(
    logits: mx.array, targets: mx.array, k: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
    """For each row of ``logits`` (rows, vocab): the target token and the ``k`` most likely
    ones, with their log-probabilities (float32 log-softmax of the logits); shapes (rows, 1+k),
    the target first, the others most likely first (ties by id)."""
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, targets.reshape(-1, 1), axis=-1)
    outputs: list[mx.array] = [targets, chosen]
    if k > 0:
        best = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        outputs += [best, mx.take_along_axis(lp, best, axis=-1)]
    mx.eval(outputs)
    ids = np.array(outputs[0], dtype=np.int32).reshape(-1, 1)
    lps = np.array(outputs[1], dtype=np.float32)
    if k > 0:
        top_ids = np.array(outputs[2], dtype=np.int32)
        top_lps = np.array(outputs[3], dtype=np.float32)
        order = np.lexsort((top_ids, -top_lps), axis=-1)
        ids = np.concatenate([ids, np.take_along_axis(top_ids, order, axis=-1)], axis=-1)
        lps = np.concatenate([lps, np.take_along_axis(top_lps, order, axis=-1)], axis=-1)
    return ids, lps


def prompt_scores(
    logits: mx.array, targets: Sequence[int], k: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
    """Scores of ``targets`` (the next prompt token at each position) from ``logits`` (one row
    per position), as ``_scores``; the rows past the targets (the prompt's last position,
    scored by the generation) are left out."""
    rows = len(targets)
    return _scores(logits[:rows], mx.array(list(targets), dtype=mx.int32), k)


def as_tokens(ids: npt.NDArray[Any], lps: npt.NDArray[Any]) -> list[Token]:
    """Rows of ``_scores`` as ``Token``s, log-probabilities floored at ``LOGPROB_FLOOR``."""
    out = []
    for row_ids, row_lps in zip(ids.tolist(), lps.tolist(), strict=True):
        lp = [floored(v) for v in row_lps]
        top = tuple(zip((int(i) for i in row_ids[1:]), lp[1:], strict=True))
        out.append(Token(int(row_ids[0]), lp[0], top))
    return out

"""How the llama.cpp engine picks a sequence's tokens: llama.cpp's own samplers in a chain, a
grammar beside the chain (tried the way llama.cpp's ``common_sampler_sample`` does), and
log-probabilities from the raw logits.

``SequenceSampler`` is one sequence's state (its chain, its grammar, its candidates); the
engine's decode loop hands it each position's logits, so a batch of sequences would hold one
each. ``GrammarCache`` keeps each grammar parsed once, for every sequence to clone.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from events.records import SamplingParams
from inference.decoding import ForcedTokens, Token, floored, request_seed
from structured.reply import Grammar, InvalidRequest, Trigger

Logits = npt.NDArray[np.float32]
Sampler = Any  # a llama_sampler pointer (llama_cpp types it only under TYPE_CHECKING)

# llama_token_data (int32 id, float logit, float p) as a numpy record: an array of them backs a
# llama_token_data_array, so loading a position's logits is one copy, not a Python loop.
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

# Tokens refused for what they would hand a lazy grammar, before giving up on the request.
_MAX_REFUSED = 64
# How many of the best candidates the grammar masks, in turn, when the picked token is refused
# (see SequenceSampler).
BEST = (512, 4096, 16384)

# llama.cpp reads this seed as "pick one at random": seeds are folded below it.
_SEEDS = 0xFFFFFFFF


def seed_of(params: SamplingParams) -> int:
    """The request's seed as llama.cpp's dist sampler takes it (32 bits), or a random one."""
    return request_seed(params) % _SEEDS


# --- log-probabilities ----------------------------------------------------------------------


def scored(logits: Logits, token: int, k: int) -> Token:
    """``token`` with its log-probability under ``logits`` (raw: log-softmax, nothing else) and
    the ``k`` most likely tokens there."""
    lse = _logsumexp(logits)
    return Token(token, floored(float(logits[token]) - lse), _top(logits, lse, k))


def _logsumexp(logits: Logits) -> float:
    peak = float(logits.max())
    return peak + math.log(float(np.exp(logits - peak).sum(dtype=np.float64)))


def _top(logits: Logits, lse: float, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    ids = np.argpartition(logits, -k)[-k:]
    ids = ids[np.lexsort((ids, -logits[ids]))]  # most likely first; ties by id, reproducibly
    return tuple((int(i), floored(float(logits[i]) - lse)) for i in ids)


# --- grammars -------------------------------------------------------------------------------


class CompiledGrammar:
    """A grammar parsed for a vocabulary, in its initial state: each sequence clones it (a
    clone copies the parsed rules, microseconds). With triggers it also keeps the grammar
    without them, to check the text a trigger would hand over (see ``SequenceSampler``)."""

    def __init__(self, sampler: Sampler, eager: Sampler | None, grammar: Grammar) -> None:
        self.sampler = sampler
        self.eager = eager
        self.triggers = [Trigger(p) for p in grammar.triggers]
        # Freed with the last reference: a cache eviction must not free a grammar that a
        # generation still waits to clone.
        weakref.finalize(self, _free, [sampler, eager])


class GrammarCache:
    """Grammars by text: a request that sends the same grammar again (a tool's schema) is not
    parsed again. Grammars that do not parse are remembered with their error."""

    def __init__(self, vocab: Any, size: int = 32) -> None:
        self._vocab = vocab
        self._size = size
        self._entries: OrderedDict[Grammar, CompiledGrammar | str] = OrderedDict()

    def get(self, grammar: Grammar) -> CompiledGrammar:
        entry = self._entries.get(grammar)
        if entry is None:
            try:
                entry = self._compile(grammar)
            except InvalidRequest as exc:
                entry = str(exc)
            self._entries[grammar] = entry
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        self._entries.move_to_end(grammar)
        if isinstance(entry, str):
            raise InvalidRequest(entry)
        return entry

    def _compile(self, grammar: Grammar) -> CompiledGrammar:
        for pattern in grammar.triggers:
            _check_trigger(pattern)
        sampler = _init_grammar(self._vocab, grammar)
        if not sampler:
            reason = _grammar_error(self._vocab, grammar)
            raise InvalidRequest(f"the grammar does not parse: {reason}")
        eager = _init_grammar(self._vocab, Grammar(grammar.gbnf)) if grammar.triggers else None
        return CompiledGrammar(sampler, eager, grammar)


def _init_grammar(vocab: Any, grammar: Grammar) -> Sampler:
    gbnf = grammar.gbnf.encode()
    if not grammar.triggers:
        return llama_cpp.llama_sampler_init_grammar(vocab, gbnf, b"root")
    patterns = (ctypes.c_char_p * len(grammar.triggers))(*(t.encode() for t in grammar.triggers))
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
        vocab, gbnf, b"root", patterns, len(grammar.triggers), None, 0
    )


_capturing = threading.Lock()


def _grammar_error(vocab: Any, grammar: Grammar) -> str:
    """Why llama.cpp refused a grammar. Its parser prints the reason to stderr, its other
    checks log it: parse it again with both caught (a refusal is rare, parsing takes
    microseconds), then pass on what was caught, as if nothing had been."""
    logged: list[tuple[int, bytes]] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def keep(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        logged.append((level, text))

    callback = llama_cpp.llama_log_callback()
    user_data = ctypes.c_void_p()
    with _capturing, tempfile.TemporaryFile() as caught:
        llama_cpp.llama_log_get(ctypes.byref(callback), ctypes.byref(user_data))
        sys.stderr.flush()
        stderr = os.dup(2)
        os.dup2(caught.fileno(), 2)
        llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
        try:
            _free([_init_grammar(vocab, grammar)])
        finally:
            llama_cpp.llama_log_set(callback, user_data)
            os.dup2(stderr, 2)
            os.close(stderr)
        caught.seek(0)
        printed = caught.read()
    os.write(2, printed)
    for level, text in logged:
        if callback:
            callback(level, text, user_data)
    reasons = [
        line.split(b"error parsing grammar:", 1)[1].strip().decode(errors="replace")
        for line in printed.splitlines()
        if b"error parsing grammar:" in line
    ]
    reasons += [text.strip().decode(errors="replace") for _, text in logged]
    reasons = [r for r in reasons if r and r != "failed to parse grammar"]
    return "; ".join(reasons) or "llama.cpp refused it"


# std::regex (ECMAScript) refuses, and then aborts the process on, some of Python's syntax:
# named groups, lookbehind, inline flags, atomic groups, possessive quantifiers, \A \Z \z.
_NOT_ECMASCRIPT = re.compile(r"\(\?[^:=!]|[*+?}]\+|\\[AZzGpPN]|\{,")


def _check_trigger(pattern: str) -> None:
    try:
        re.compile(pattern.encode())
    except re.error as exc:
        raise InvalidRequest(
            f"the grammar's trigger {pattern!r} is no regular expression: {exc}"
        ) from exc
    if _NOT_ECMASCRIPT.search(pattern):
        raise InvalidRequest(f"the grammar's trigger {pattern!r} uses syntax llama.cpp lacks")


def _free(samplers: Iterable[Sampler | None]) -> None:
    for sampler in samplers:
        if sampler:
            llama_cpp.llama_sampler_free(sampler)


# --- one sequence ---------------------------------------------------------------------------


class Candidates:
    """A ``llama_token_data_array`` in numpy memory: the whole vocabulary, or one token."""

    def __init__(self, n: int) -> None:
        self.data = np.zeros(n, TOKEN_DATA)
        self._ids = np.arange(n, dtype=np.int32)
        self.array = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=n,
            selected=-1,
            sorted=False,
        )
        self.pointer = ctypes.pointer(self.array)

    def load(self, logits: Logits, banned: Sequence[int] = ()) -> None:
        # Samplers sort and cut the array in place: each pass starts from the logits.
        self.data["id"] = self._ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        if banned:
            self.data["logit"][list(banned)] = -np.inf
        self._reset(len(self.data))

    def load_entries(self, entries: npt.NDArray[np.void]) -> None:
        """These entries (as many as this array holds), in no order: samplers need none."""
        self.data[:] = entries
        self._reset(len(entries))

    def one(self, token: int) -> None:
        self.data[0] = (token, 1.0, 0.0)
        self._reset(1)

    def _reset(self, size: int) -> None:
        self.array.size = size
        self.array.selected = -1
        self.array.sorted = False

    def any_allowed(self) -> bool:
        return bool(np.isfinite(self.data["logit"][: self.array.size]).any())

    def selected(self) -> tuple[int, float]:
        i = self.array.selected
        if not 0 <= i < self.array.size:
            raise RuntimeError("the sampler chain selected no token")
        entry = self.array.data[i]
        return int(entry.id), float(entry.logit)


class SequenceSampler:
    """Picks one sequence's tokens: llama.cpp's samplers (logit bias, penalties, top-k, top-p,
    min-p, temperature, then greedy or a seeded draw) in one chain, and the grammar, if any,
    beside it.

    The grammar is not applied to the whole vocabulary at every token (on a small model that
    costs about as much as the token itself; docs/runners.md): as in ``common_sampler_sample``,
    the chain picks a token, the grammar checks that one alone, and a token it refuses is set
    aside for the chain to pick again (``retries`` times). Then the grammar masks the best
    candidates by logit (after biases and penalties: the 512 best, the 4096, the 16384) and the
    chain picks from what it allows there; only if it allows none of them does it mask every
    candidate (a key the schema names, which the model did not expect, is often thousands of
    tokens down). Greedy, that is the best allowed token; drawn, a draw from the allowed
    tokens in proportion to their probabilities, as if a top-k of 512 (or more) came first
    where those hold an allowed token (top-k, top-p and min-p cut before the grammar here,
    after it otherwise, as in llama.cpp). ``grammar_first`` masks every candidate at every
    token.

    Only generated tokens are accepted into the chain: penalties count what was generated, not
    the prompt, as OpenAI's do."""

    def __init__(
        self,
        *,
        vocab: Any,
        n_vocab: int,
        n_ctx: int,
        params: SamplingParams,
        seed: int,
        grammar: CompiledGrammar | None = None,
        grammar_first: bool = False,
        retries: int = 0,
        forced: ForcedTokens | None = None,
    ) -> None:
        self._vocab = vocab
        self._forced = forced
        self._grammar_first = grammar_first
        self._retries = retries
        self._candidates = Candidates(n_vocab)
        self._best = [Candidates(k) for k in BEST if k < n_vocab]
        self._one = Candidates(1)
        self._adjust = _adjustments(params, n_vocab, n_ctx)
        self._chain = _chain(params, seed)
        self._grammar: Sampler | None = None
        self._eager: Sampler | None = None
        self._triggers: list[Trigger] = []
        if grammar is not None:
            self._grammar = llama_cpp.llama_sampler_clone(grammar.sampler)
            self._eager = grammar.eager  # the cache's: a reference is kept with ``grammar``
            self._triggers = grammar.triggers
        self._compiled = grammar
        # Greedy with nothing to adjust and no grammar: the best logit, read off the logits
        # (loading them as candidates copies the whole vocabulary: 3 MiB a token for Gemma).
        self._argmax = params.temperature == 0 and self._adjust is None and grammar is None
        self._free = weakref.finalize(self, _free, [self._adjust, self._chain, self._grammar])
        self._text = b""  # generated so far, while a lazy grammar waits for its trigger

    def close(self) -> None:
        self._free()

    def sample(self, logits: Logits) -> int:
        """The next token after a position with these logits; it is accepted (the chain's and
        the grammar's states move on). A forced token (``ForcedTokens``: a thinking budget's
        closing tag) is taken instead of a pick, unless the grammar refuses it (then none
        more is forced, and the pick goes on)."""
        if self._forced is not None and (forced := self._forced.next()) is not None:
            if self._can_force(forced):
                self._accept(forced)
                return forced
            self._forced.clear()
        banned: list[int] = []
        while True:
            token = self._pick(logits, banned)
            if not self._triggers or self._hands_over_well(token):
                break
            banned.append(token)
            if len(banned) > _MAX_REFUSED:
                raise InvalidRequest("the grammar refuses what its trigger would hand it")
        self._accept(token)
        return token

    def _can_force(self, token: int) -> bool:
        """Whether the grammar takes ``token`` (accepting one it refuses would abort)."""
        if self._grammar is None:
            return True
        return self._allows(token) and (not self._triggers or self._hands_over_well(token))

    def take_generated(self, tokens: Sequence[int]) -> None:
        """Tokens this sequence generated before (a resumed task), accepted as if picked: the
        penalties count them and the grammar goes on after them."""
        for token in tokens:
            self._accept(token)

    def _pick(self, logits: Logits, banned: Sequence[int]) -> int:
        if self._argmax and not banned:
            return int(np.argmax(logits))  # the first of equal bests, as llama.cpp's greedy
        if self._grammar is None:
            return self._draw(logits, banned)
        if self._grammar_first:
            return self._draw_allowed(logits, banned)
        refused = list(banned)
        for _ in range(1 + self._retries):
            token = self._draw(logits, refused)
            if self._allows(token):
                return token
            refused.append(token)
        return self._draw_allowed(logits, refused)

    def _adjusted(self, logits: Logits, banned: Sequence[int]) -> Candidates:
        self._candidates.load(logits, banned)
        if self._adjust is not None:
            llama_cpp.llama_sampler_apply(self._adjust, self._candidates.pointer)
        return self._candidates

    def _draw(self, logits: Logits, banned: Sequence[int]) -> int:
        candidates = self._adjusted(logits, banned)
        llama_cpp.llama_sampler_apply(self._chain, candidates.pointer)
        return candidates.selected()[0]

    def _draw_allowed(self, logits: Logits, banned: Sequence[int]) -> int:
        candidates = self._adjusted(logits, banned)
        if self._best and not self._grammar_first:
            # The widest tier's ids once, each narrower one's among them.
            adjusted = np.ascontiguousarray(candidates.data["logit"])
            widest = len(self._best[-1].data)
            pool = np.argpartition(-adjusted, widest - 1)[:widest]
            for best in self._best:
                k = len(best.data)
                ids = pool if k == widest else pool[np.argpartition(-adjusted[pool], k - 1)[:k]]
                best.load_entries(candidates.data[ids])
                llama_cpp.llama_sampler_apply(self._grammar, best.pointer)
                if best.any_allowed():
                    llama_cpp.llama_sampler_apply(self._chain, best.pointer)
                    return best.selected()[0]
        llama_cpp.llama_sampler_apply(self._grammar, candidates.pointer)
        llama_cpp.llama_sampler_apply(self._chain, candidates.pointer)
        token, logit = candidates.selected()
        if logit == -math.inf:
            # Accepting it would abort the process (llama.cpp's grammar has no way out).
            raise InvalidRequest("the grammar allows no token here")
        return token

    def _allows(self, token: int, grammar: Sampler | None = None) -> bool:
        self._one.one(token)
        llama_cpp.llama_sampler_apply(grammar or self._grammar, self._one.pointer)
        return bool(self._one.data[0]["logit"] != -np.inf)

    def _accept(self, token: int) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_accept(self._grammar, token)
        if self._adjust is not None:
            llama_cpp.llama_sampler_accept(self._adjust, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        if self._triggers:
            self._text += token_piece(self._vocab, token)
            if any(t.start(self._text) is not None for t in self._triggers):
                self._triggers = []  # the grammar holds from here on

    def _hands_over_well(self, token: int) -> bool:
        """Whether, if ``token`` fires a trigger, the grammar can take the text it hands over.

        llama.cpp feeds a lazy grammar the text from the trigger's start when one matches, and
        aborts the process if the grammar cannot take it (a token that completes the trigger
        and goes on with text the grammar refuses, "<tool_call>." say). Such a token is
        refused here instead, and the chain picks another."""
        text = self._text + token_piece(self._vocab, token)
        # The first pattern that matches, as llama.cpp tries them.
        start = next((s for t in self._triggers if (s := t.start(text)) is not None), None)
        if start is None:
            return True
        assert self._eager is not None
        check = llama_cpp.llama_sampler_clone(self._eager)
        try:
            for t in _tokenize(self._vocab, text[start:].decode(errors="ignore")):
                if not self._allows(t, check):
                    return False
                llama_cpp.llama_sampler_accept(check, t)
            return True
        finally:
            llama_cpp.llama_sampler_free(check)


def _new_chain() -> Sampler:
    return llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())


def _adjustments(params: SamplingParams, n_vocab: int, n_ctx: int) -> Sampler | None:
    """What changes the logits before any cut, in common_sampler's order: biases, then
    penalties (over the whole generation: OpenAI's penalties count every generated token).
    None when there is nothing to change."""
    penalised = (params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
    if not params.logit_bias and penalised == (1, 0, 0):
        return None
    chain = _new_chain()
    if params.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
            *(llama_cpp.llama_logit_bias(token=t, bias=b) for t, b in params.logit_bias.items())
        )
        bias = llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases)
        llama_cpp.llama_sampler_chain_add(chain, bias)  # the chain owns it from here
    if penalised != (1, 0, 0):
        penalties = llama_cpp.llama_sampler_init_penalties(n_vocab, n_ctx, *penalised)
        llama_cpp.llama_sampler_chain_add(chain, penalties)
    return chain


def _chain(params: SamplingParams, seed: int) -> Sampler:
    """The pick, in common_sampler's order: greedy, or the cuts, the temperature, the draw."""
    chain = _new_chain()

    def add(sampler: Sampler) -> None:
        llama_cpp.llama_sampler_chain_add(chain, sampler)  # the chain owns it from here

    if params.temperature == 0:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1:
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0:
        add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    if params.temperature != 1:
        add(llama_cpp.llama_sampler_init_temp(params.temperature))
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def token_piece(vocab: Any, token: int, special: bool = True) -> bytes:
    """A token's bytes; ``special``: special tokens spelled out, as llama.cpp's grammar sees
    them (else they have none, as generated text shows them)."""
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:  # a longer piece: its length, negated
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]


def _tokenize(vocab: Any, text: str) -> list[int]:
    data = text.encode()
    tokens = (llama_cpp.llama_token * (len(data) + 1))()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), tokens, len(tokens), False, False)
    return list(tokens[: max(n, 0)])

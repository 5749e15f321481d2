"""Speculative decoding without a second model: prompt lookup (llama.cpp's ``ngram-simple``,
vLLM's ``[ngram]``). The tokens that followed the last earlier occurrence of the context's
final n-gram are proposed as a draft; the engine evaluates the next token and the draft in one
batch, then samples each position in order with the request's own sampler and keeps the draft
up to the first token the sampler did not pick (``verified``).

Sampling every verified position with the sampler, rather than accepting a draft token by some
other test, is what makes the output equal to decoding without speculation, token for token,
for any sampler: each token is drawn from the same logits (the same prefix was evaluated) by
the same sampler state (grammar, penalties, random generator), and no token past the first
mismatch is drawn. A draft only decides how many positions one decode computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramLookup:
    """How drafts are looked up: the longest n-gram from ``n_max`` down to ``n_min`` tokens
    that occurred before, and at most ``draft_max`` tokens of what followed it."""

    n_max: int = 4
    n_min: int = 2
    draft_max: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"n-gram sizes {self.n_min}..{self.n_max}: need 1 <= min <= max")
        if self.draft_max < 1:
            raise ValueError(f"draft_max must be at least 1, not {self.draft_max}")


class NgramIndex:
    """A sequence's tokens and, for each n-gram of the sizes looked up, where it last ended:
    a draft is found in constant time per size however long the context (a scan of a 32k-token
    context at every step would cost more than the draft saves)."""

    def __init__(self, lookup: NgramLookup, tokens: Sequence[int] = ()) -> None:
        self.lookup = lookup
        self._tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence that is not the sequence's end.
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._index_ending_here()
            self._tokens.append(token)

    def _index_ending_here(self) -> None:
        """Records the n-grams that end at the current last token: once a token follows them,
        they are earlier occurrences a later n-gram can be matched against."""
        end = len(self._tokens)
        for n in range(self.lookup.n_min, self.lookup.n_max + 1):
            if end >= n:
                self._after[tuple(self._tokens[end - n : end])] = end

    def truncate(self, length: int) -> None:
        """Forgets the tokens from ``length`` on (a rejected draft, a context cut): the index is
        rebuilt, which is rare and linear."""
        if length < len(self._tokens):
            kept = self._tokens[:length]
            self._tokens, self._after = [], {}
            self.extend(kept)

    def draft(self, limit: int | None = None) -> list[int]:
        """What followed the latest earlier occurrence of the longest final n-gram found, at most
        ``draft_max`` (and ``limit``) tokens; empty when none occurred before."""
        most = self.lookup.draft_max if limit is None else min(limit, self.lookup.draft_max)
        end = len(self._tokens)
        if most <= 0:
            return []
        for n in range(self.lookup.n_max, self.lookup.n_min - 1, -1):
            if end < n:
                continue
            start = self._after.get(tuple(self._tokens[end - n : end]))
            if start is not None:
                return self._tokens[start : min(start + most, end)]
        return []


def verified(draft: Sequence[int], sample: Callable[[int], int | None]) -> list[int]:
    """The tokens a verification step gives: ``sample(i)`` picks the token at draft position
    ``i`` (from the logits after the next token and ``draft[:i]``), or None when the sequence
    ended there (its limit, its end token, a grammar it could not follow); each pick that
    equals the draft's token lets the next position be sampled. The last token returned is
    the first that differs from the draft (or the one after the whole draft): the sampler
    picked it from the right logits, so it is kept too."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        token = sample(i)
        if token is None:
            break
        out.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return out

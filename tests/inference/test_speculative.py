"""Prompt-lookup drafts and their verification (inference/speculative.py): pure, so checked
against a plain scan of the context and a plain token-by-token decode."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.speculative import NgramIndex, NgramLookup, verified


def scanned(tokens: list[int], lookup: NgramLookup) -> list[int]:
    """The draft by brute force: the longest final n-gram's latest earlier occurrence."""
    end = len(tokens)
    for n in range(lookup.n_max, lookup.n_min - 1, -1):
        if end < n:
            continue
        gram = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == gram:
                return tokens[start + n : min(start + n + lookup.draft_max, end)]
    return []


def test_code_being_rewritten_is_drafted_from_where_it_was() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11, 3, 5, 6]
    index = NgramIndex(NgramLookup(n_max=3, n_min=2, draft_max=4), prompt)
    assert index.draft() == [7, 8, 9, 10]
    assert index.draft(limit=2) == [7, 8]
    index.extend([7])
    assert index.draft() == [8, 9, 10, 11]  # the 3-gram 5 6 7 now matches


def test_nothing_is_drafted_for_an_unseen_ngram() -> None:
    assert NgramIndex(NgramLookup(), [1, 2, 3, 4]).draft() == []
    assert NgramIndex(NgramLookup(), []).draft() == []


def test_the_latest_occurrence_wins() -> None:
    index = NgramIndex(NgramLookup(n_max=2, n_min=2, draft_max=1), [1, 2, 3, 1, 2, 4, 1, 2])
    assert index.draft() == [4]


def test_truncating_forgets_the_rejected_tokens() -> None:
    index = NgramIndex(NgramLookup(n_max=2, n_min=2), [1, 2, 3, 9, 9, 1, 2])
    index.truncate(5)
    assert len(index) == 5
    assert index.draft() == [] and scanned([1, 2, 3, 9, 9], index.lookup) == []
    index.extend([1, 2])
    assert index.draft() == [3, 9, 9, 1, 2]


@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 8),
)
def test_the_index_drafts_what_a_scan_finds(
    tokens: list[int], n_min: int, extra: int, draft_max: int
) -> None:
    lookup = NgramLookup(n_max=n_min + extra, n_min=n_min, draft_max=draft_max)
    index = NgramIndex(lookup)
    for i, token in enumerate(tokens):
        index.extend([token])
        assert index.draft() == scanned(tokens[: i + 1], lookup)


@pytest.mark.parametrize(("n_min", "n_max", "draft_max"), [(0, 2, 4), (3, 2, 4), (1, 2, 0)])
def test_a_lookup_that_cannot_draft_is_refused(n_min: int, n_max: int, draft_max: int) -> None:
    with pytest.raises(ValueError):
        NgramLookup(n_max=n_max, n_min=n_min, draft_max=draft_max)


def decoded(next_token: dict[tuple[int, ...], int], prefix: tuple[int, ...], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        token = next_token[prefix + tuple(out)]
        out.append(token)
    return out


@given(st.lists(st.integers(0, 2), max_size=6), st.integers(0, 2**32))
def test_verification_gives_what_decoding_one_by_one_gives(draft: list[int], seed: int) -> None:
    """A random "model" (a next token for every prefix): the verified tokens are the decoded
    ones, as many as the draft got right plus one."""
    rng = random.Random(seed)
    table: dict[tuple[int, ...], int] = {}

    def model(prefix: tuple[int, ...]) -> int:
        return table.setdefault(prefix, rng.randrange(3))

    got = verified(draft, lambda i: model(tuple(draft[:i])))
    right = next((i for i, t in enumerate(draft) if model(tuple(draft[:i])) != t), len(draft))
    assert len(got) == right + 1
    assert got == decoded(table, (), len(got))


def test_verification_stops_where_the_sequence_ends() -> None:
    ends_at = 2
    got = verified([4, 4, 4, 4], lambda i: None if i == ends_at else 4)
    assert got == [4, 4]

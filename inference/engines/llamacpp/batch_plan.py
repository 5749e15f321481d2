"""What goes in a step of the llama.cpp engine's batch, and which slot a prompt takes: pure
functions (``batch.py`` is the decoder that uses them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A prompt that is scored (echo) needs the logits of every position; llama.cpp keeps an output
# buffer as large as the largest batch's logits for the context's life (n_batch of 512 with
# Gemma's 262k vocabulary: 512 MiB), so such prompts go in smaller chunks.
ECHO_CHUNK = 64


@dataclass(frozen=True)
class Need:
    """What a sequence needs from the next step: ``prefill`` prompt tokens still to run (0:
    it is decoding, one token a step, and ``draft`` more tokens if the batch has room:
    speculative decoding's guesses, verified in the same step)."""

    key: int
    prefill: int = 0
    echo: bool = False
    draft: int = 0


def plan_step(needs: Sequence[Need], capacity: int, echo_chunk: int = ECHO_CHUNK) -> dict[int, int]:
    """How many tokens each sequence (by key: its slot) puts in the next batch of
    ``capacity``: every decoding sequence its next token first (a prompt never holds the
    others' tokens back by more than one batch), then prompts in the order given, as much as is
    left; a scored prompt at most ``echo_chunk`` a step; then the decoding sequences' drafts,
    in the order given, in what room is left (a draft only saves time: it never holds a prompt
    back).

    The plan lists the sequences by key, the order they go in the batch: with a KV cache per
    sequence, llama.cpp computes a batch in one pass per run of consecutive sequence ids, so
    that 8 sequences in admission order (0, 2, 4, 6, 3...) took several passes where one does."""
    plan: dict[int, int] = {}
    room = capacity
    for need in needs:
        if need.prefill == 0 and room > 0:
            plan[need.key] = 1
            room -= 1
    for need in needs:
        if need.prefill > 0 and room > 0:
            take = min(need.prefill, room, echo_chunk if need.echo else room)
            plan[need.key] = take
            room -= take
    for need in needs:
        if need.prefill == 0 and need.draft > 0 and room > 0 and need.key in plan:
            take = min(need.draft, room)
            plan[need.key] += take
            room -= take
    return dict(sorted(plan.items()))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# A slot's cache counts for a prompt when it holds more than this share of it (llama.cpp's
# server: --slot-prompt-similarity, 0.1); fewer common tokens than that are not worth a slot.
SIMILARITY = 0.1
# Common tokens from which a prefix is copied into another slot rather than computed again
# (a copy moves the slot's whole KV cache: milliseconds, where 16 tokens of prompt take tens).
MIN_COPY = 16


@dataclass(frozen=True)
class SlotChoice:
    """The slot a prompt takes, how many of its first tokens are there already, and the slot
    they are copied from first (None: the slot's own cache has them)."""

    slot: int
    keep: int
    copy_from: int | None = None


def pick_slot(
    free: Sequence[int],
    cached: Mapping[int, Sequence[int]],
    last_used: Mapping[int, float],
    prompt: Sequence[int],
) -> SlotChoice:
    """The free slot whose cache shares the longest prefix with the prompt (never the whole
    prompt: its last token must run, its logits give the first token), if that is more than
    ``SIMILARITY`` of it; otherwise the slot used least recently (an empty one first). When
    the best slot's own conversation would lose most of its cache for that prefix (a new chat
    sharing a system prompt with it), the prefix is copied to the slot used least recently
    instead, and the conversation keeps its slot for its next turn."""

    def reuse(slot: int) -> int:
        return common_prefix(cached.get(slot, ()), prompt[: len(prompt) - 1])

    def age(slot: int) -> float:
        return last_used.get(slot, 0.0)

    oldest = min(free, key=age)
    best = max(free, key=lambda s: (reuse(s), -age(s)))
    kept = reuse(best)
    if kept <= SIMILARITY * len(prompt):
        return SlotChoice(oldest, reuse(oldest))
    if best != oldest and kept >= MIN_COPY and 2 * kept < len(cached.get(best, ())):
        return SlotChoice(oldest, kept, copy_from=best)
    return SlotChoice(best, kept)

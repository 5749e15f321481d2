"""Where a prompt's images are: the engine-neutral part of reading them. Pure.

A prompt with images is still a list of token ids, one per position it takes in the KV cache:
an image's tokens are its chunk's, each the same negative id made from the image's digest
(``image_token``), so that the prompt's length counts them (usage, the context check), and a
cached prefix matches another prompt's only through the same image at the same place (the
prompt cache's comparison of tokens then never reuses one image's cache for another). An
``ImageSpan`` says where each image chunk is, how many tokens and positions it takes, and
holds the engine's chunk, which the engine evaluates apart from the text.

Positions: a model with M-RoPE (Qwen2-VL, Qwen2.5-VL) gives an image fewer positions than
tokens; the text after it goes on from the image's first position plus its positions
(``position``). Elsewhere a position is the token's index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ImageSpan:
    """One image chunk of a prompt: its first token's index, its tokens and positions, the id
    its tokens hold in the prompt, and the engine's chunk (what it evaluates)."""

    start: int
    n_tokens: int
    n_pos: int
    token: int
    chunk: object = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's tokens (an image's positions hold its ``image_token``) and its images."""

    tokens: list[int]
    images: tuple[ImageSpan, ...] = ()


def image_token(chunk_id: str, ordinal: int) -> int:
    """The id an image chunk's tokens hold in a prompt: negative (no vocabulary has it), from
    the image's digest (libmtmd's chunk id is the SHA-256 of the image's bytes) and which of
    that image's chunks it is (a tiling projector cuts one image into several). Within 32 bits:
    mlx-lm keeps a sequence's tokens as int32."""
    digest = hashlib.sha256(f"{chunk_id}:{ordinal}".encode()).digest()
    return -1 - (int.from_bytes(digest[:4]) >> 1)


def position(spans: Sequence[ImageSpan], index: int) -> int:
    """The position of the token at ``index`` (past the prompt: a generated token's); an
    image's first token is at the image's position."""
    shift = 0
    for span in spans:
        if span.end > index:
            break
        shift += span.n_tokens - span.n_pos
    return index - shift


def image_at(spans: Sequence[ImageSpan], index: int) -> ImageSpan | None:
    """The image chunk that starts at ``index``, if one does."""
    return next((s for s in spans if s.start == index), None)


def text_run(spans: Sequence[ImageSpan], index: int, end: int) -> int:
    """How many of the tokens from ``index`` (not inside an image) to ``end`` are text before
    the next image: what the shared batch may take of them."""
    following = [s.start for s in spans if s.start >= index]
    return min([end, *following]) - index


def kept(spans: Sequence[ImageSpan], keep: int) -> int:
    """``keep`` cached tokens, never part of an image: a cache holding an image's first
    tokens only cannot be gone on from (the image is evaluated whole)."""
    for span in spans:
        if span.start < keep < span.end:
            return span.start
    return keep


def without_first(prompt: ImagePrompt) -> ImagePrompt:
    """The prompt without its first token (a BOS written twice), its images moved with it."""
    spans = tuple(
        ImageSpan(s.start - 1, s.n_tokens, s.n_pos, s.token, s.chunk) for s in prompt.images
    )
    return ImagePrompt(prompt.tokens[1:], spans)


def unreadable(spans: Sequence[ImageSpan], prompt_length: int, echo: bool) -> str | None:
    """Why a prompt with images cannot be generated from, whatever the engine; None: it can."""
    if not spans:
        return None
    if echo:
        return "a prompt with images cannot be scored (echo)"
    if spans[-1].end >= prompt_length:
        return "the prompt ends with an image: nothing follows it"
    return None

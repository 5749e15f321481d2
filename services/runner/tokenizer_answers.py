"""What a runner answers about its model's tokenizer (``events/tokenizer.py``): a text's tokens, a
chat's prompt tokens exactly as a chat task of it would be given to the model (``job.py``'s
``chat_prompt``; an image's tokens are its ``image_token``s, no vocabulary's), tokens back to
text, the tokenizer's settings. Pure given the engine (and the chat's images, read before)."""

from __future__ import annotations

from collections.abc import Mapping

from events.tokenizer import (
    DescribeTokenizer,
    Detokenize,
    TokenizeChat,
    TokenizerAnswer,
    TokenizerAsk,
    TokenizeText,
    TokenPiece,
)
from inference.engines.base import Engine
from inference.job import chat_prompt
from structured.reply import InvalidRequest


def answer(
    engine: Engine, ask: TokenizerAsk, images: Mapping[str, bytes] | None = None
) -> TokenizerAnswer:
    """The answer to ``ask`` (``images``: the bytes of a chat's images, by digest); a question
    the engine cannot answer (a token outside the vocabulary, a chat its template rejects) is
    answered with why."""
    try:
        return _answer(engine, ask, images or {})
    except InvalidRequest as exc:
        return TokenizerAnswer(n_ctx=engine.n_ctx, refused="invalid_request", error=str(exc))


def _answer(engine: Engine, ask: TokenizerAsk, images: Mapping[str, bytes]) -> TokenizerAnswer:
    if isinstance(ask, Detokenize):
        return TokenizerAnswer(text=engine.detokenize(ask.tokens), n_ctx=engine.n_ctx)
    if isinstance(ask, DescribeTokenizer):
        return TokenizerAnswer(info=engine.tokenizer_info(), n_ctx=engine.n_ctx)
    if isinstance(ask, TokenizeText):
        tokens = engine.tokenize(
            ask.text, add_special=ask.add_special, parse_special=ask.parse_special
        )
    else:
        tokens = _chat_tokens(engine, ask, images)
        if ask.count_only:
            return TokenizerAnswer(count=len(tokens), n_ctx=engine.n_ctx)
    if not ask.with_pieces:
        return TokenizerAnswer(tokens=tokens, count=len(tokens), n_ctx=engine.n_ctx)
    return TokenizerAnswer(
        tokens=tokens,
        count=len(tokens),
        pieces=[TokenPiece(id=t, piece=piece_of(engine.spelled(t))) for t in tokens],
        vocabulary=[engine.vocabulary_text(t) for t in tokens],
        n_ctx=engine.n_ctx,
    )


def _chat_tokens(engine: Engine, ask: TokenizeChat, images: Mapping[str, bytes]) -> list[int]:
    # As a served task's messages and tools come to its runner: through their parts.
    tokens = chat_prompt(engine, ask.task, ask.add_generation_prompt, images)
    if ask.add_special:
        # The BOS a text gets, in front unless the template wrote it already.
        bos = engine.tokenize("", add_special=True, parse_special=False)[:1]
        if bos and tokens[:1] != bos:
            tokens = bos + tokens
    return tokens


def piece_of(spelled: bytes) -> str | list[int]:
    """A token's piece as llama.cpp's server gives it: its text when its bytes are UTF-8,
    else the bytes (a token that holds part of a character)."""
    try:
        return spelled.decode()
    except UnicodeDecodeError:
        return list(spelled)

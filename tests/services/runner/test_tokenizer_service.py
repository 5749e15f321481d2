"""A runner's tokenizer service on a real nats-server: one runner of a model's queue group
answers each question, a failure is answered (not left to time out), an answer too large for
a NATS message says so, and a runner that stopped serving answers no more."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import nats.errors
import pytest
from nats.aio.client import Client

from events.subjects import tokenizer_subject
from events.tokenizer import Detokenize, TokenizerAnswer, TokenizerQuestion, TokenizeText
from inference.engines.base import Engine
from services.runner.tokenizer_service import TokenizerService


class _Letters:
    """A tokenizer of one token per character."""

    n_ctx = 128

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        if text == "boom":
            raise RuntimeError("the tokenizer broke")
        return [ord(c) for c in text]

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)


def _service(nc: Client, model: str = "m") -> TokenizerService:
    return TokenizerService(nc, cast(Engine, _Letters()), model)


async def _ask(nc: Client, ask: Any, model: str = "m") -> TokenizerAnswer:
    data = TokenizerQuestion(ask=ask).model_dump_json().encode()
    reply = await nc.request(tokenizer_subject(model), data, timeout=5)
    return TokenizerAnswer.model_validate_json(reply.data)


async def test_one_runner_of_the_group_answers_each_question(nc: Client) -> None:
    services = [_service(nc), _service(nc)]
    for s in services:
        await s.start()
    try:
        answers = await asyncio.gather(*(_ask(nc, TokenizeText(text="ab")) for _ in range(40)))
        assert all(a.tokens == [97, 98] and a.count == 2 and a.n_ctx == 128 for a in answers)
        assert sum(s.answered for s in services) == 40  # each once, by one of them
        assert (await _ask(nc, Detokenize(tokens=[104, 105]))).text == "hi"
    finally:
        for s in services:
            await s.stop()


async def test_failures_and_oversized_answers_are_answered(nc: Client) -> None:
    service = _service(nc)
    await service.start()
    try:
        failed = await _ask(nc, TokenizeText(text="boom"))
        assert failed.refused == "failed" and failed.error and "broke" in failed.error
        malformed = await nc.request(tokenizer_subject("m"), b"{}", timeout=5)
        assert TokenizerAnswer.model_validate_json(malformed.data).refused == "invalid_request"
        huge = await _ask(nc, TokenizeText(text="x" * (nc.max_payload // 3)))
        assert huge.refused == "too_large" and huge.error and "NATS message" in huge.error
    finally:
        await service.stop()


async def test_another_models_runner_or_a_stopped_one_does_not_answer(nc: Client) -> None:
    service = _service(nc, "other")
    await service.start()
    with pytest.raises(nats.errors.NoRespondersError):
        await _ask(nc, TokenizeText(text="a"), "m")
    await service.stop()
    with pytest.raises(nats.errors.NoRespondersError):
        await _ask(nc, TokenizeText(text="a"), "other")

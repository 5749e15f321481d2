"""Questions to a model's tokenizer, as they cross from the API to a runner and back."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from events.catalogue import TaskCreated
from events.records import ChatMessage
from events.tokenizer import (
    DescribeTokenizer,
    Detokenize,
    TokenizeChat,
    TokenizerAnswer,
    TokenizerQuestion,
    TokenizeText,
    TokenPiece,
)

CHAT = TaskCreated(
    task_id="t", model_id="m", origin="api", messages=[ChatMessage(role="user", content="Hi")]
)


@pytest.mark.parametrize(
    "ask",
    [
        TokenizeText(text="Hello <|im_start|>", add_special=True, parse_special=False),
        TokenizeChat(task=CHAT, add_generation_prompt=False, count_only=True),
        Detokenize(tokens=[1, 2, 3]),
        DescribeTokenizer(),
    ],
)
def test_each_question_crosses_as_itself(ask: object) -> None:
    sent = TokenizerQuestion.model_validate({"ask": ask}).model_dump_json()
    assert TokenizerQuestion.model_validate_json(sent).ask == ask


def test_a_question_of_no_known_kind_is_refused() -> None:
    with pytest.raises(ValidationError):
        TokenizerQuestion.model_validate_json('{"ask": {"kind": "guess", "text": "x"}}')


def test_an_answer_without_its_empty_fields_reads_back_the_same() -> None:
    answer = TokenizerAnswer(
        tokens=[5, 6],
        count=2,
        pieces=[TokenPiece(id=5, piece="a"), TokenPiece(id=6, piece=[195])],
        n_ctx=512,
    )
    sent = answer.model_dump_json(exclude_none=True)
    assert "refused" not in sent and "info" not in sent
    assert TokenizerAnswer.model_validate_json(sent) == answer

"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in llama.cpp's and vLLM's shapes,
data in and data out: which shape a body is, the question it becomes, the answer's shape."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from api.tokenizer.shapes import (
    DetokenizeBody,
    LlamaTokenize,
    NoShape,
    VllmTokenizeChat,
    VllmTokenizeText,
    detokenized,
    invalid,
    tokenize_body,
    tokenized,
)
from events.records import ToolChoice
from events.tokenizer import TokenizeChat, TokenizerAnswer, TokenizeText, TokenPiece

ANSWER = TokenizerAnswer(
    tokens=[9906, 1917],
    count=2,
    pieces=[TokenPiece(id=9906, piece="Hello"), TokenPiece(id=1917, piece=[195])],
    vocabulary=["Hello", "Ã"],
    n_ctx=2048,
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_each_shape_is_told_by_its_fields() -> None:
    assert isinstance(tokenize_body({"content": "Hi"}), LlamaTokenize)
    assert isinstance(tokenize_body({"model": "m", "prompt": "Hi"}), VllmTokenizeText)
    chat = tokenize_body({"messages": [{"role": "user", "content": "Hi"}]})
    assert isinstance(chat, VllmTokenizeChat)
    with pytest.raises(NoShape, match="content"):
        tokenize_body({"text": "Hi"})


def test_llama_cpps_defaults_and_flags() -> None:
    body = tokenize_body({"content": "Hi <|im_end|>"})
    assert isinstance(body, LlamaTokenize) and body.model is None
    assert body.ask() == TokenizeText(text="Hi <|im_end|>", add_special=False, parse_special=True)
    flagged = LlamaTokenize(content="x", add_special=True, parse_special=False, with_pieces=True)
    assert flagged.ask() == TokenizeText(
        text="x", add_special=True, parse_special=False, with_pieces=True
    )


def test_vllms_text_adds_special_tokens_by_default() -> None:
    body = VllmTokenizeText(prompt="Hi")
    assert body.ask() == TokenizeText(text="Hi", add_special=True, parse_special=True)
    assert VllmTokenizeText(prompt="Hi", add_special_tokens=False).ask().add_special is False
    assert VllmTokenizeText(prompt="Hi", return_token_strs=True).ask().with_pieces


def test_a_chat_becomes_the_task_a_chat_completion_of_it_would_be() -> None:
    body = VllmTokenizeChat.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "tools": [WEATHER],
            "reasoning_effort": "none",
            "chat_template_kwargs": {"custom": 1},
        }
    )
    ask = body.ask("smollm2", "api@here")
    assert isinstance(ask, TokenizeChat)
    assert ask.add_generation_prompt and not ask.add_special and not ask.with_pieces
    task = ask.task
    assert task.model_id == "smollm2" and task.kind == "chat"
    assert [m.role for m in task.messages or []] == ["system", "user"]
    assert [t.name for t in task.tools] == ["get_weather"]
    assert task.tool_choice == ToolChoice(mode="auto")  # as a completion with tools
    assert task.thinking is False and task.chat_template_kwargs == {"custom": 1}
    bare = VllmTokenizeChat.model_validate(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "add_generation_prompt": False,
            "add_special_tokens": True,
            "return_token_strs": True,
        }
    ).ask("m", "api")
    assert not bare.add_generation_prompt and bare.add_special and bare.with_pieces


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "image",
        ),
    ],
)
def test_what_a_chat_cannot_honour_is_refused(fields: dict[str, Any], says: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}]} | fields
    with pytest.raises(ValidationError, match=says):
        tokenize_body(body)


def test_an_invalid_body_names_its_field_in_the_body() -> None:
    with pytest.raises(ValidationError) as caught:
        tokenize_body({"content": 5})
    [error] = invalid(caught.value)
    assert error["loc"] == ("body", "content")


def test_llama_cpps_answer_is_ids_or_pieces() -> None:
    assert tokenized(LlamaTokenize(content="x"), ANSWER) == {"tokens": [9906, 1917]}
    with_pieces = tokenized(LlamaTokenize(content="x", with_pieces=True), ANSWER)
    assert with_pieces == {"tokens": [{"id": 9906, "piece": "Hello"}, {"id": 1917, "piece": [195]}]}


def test_vllms_answer_counts_and_says_the_context() -> None:
    assert tokenized(VllmTokenizeText(prompt="x"), ANSWER) == {
        "count": 2,
        "max_model_len": 2048,
        "tokens": [9906, 1917],
    }
    asked = tokenized(VllmTokenizeText(prompt="x", return_token_strs=True), ANSWER)
    assert asked["token_strs"] == ["Hello", "Ã"]
    chat = VllmTokenizeChat.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert tokenized(chat, ANSWER)["count"] == 2


def test_detokenizing_answers_under_both_names() -> None:
    body = DetokenizeBody.model_validate({"tokens": [1, 2]})
    assert body.model is None and body.ask().tokens == [1, 2]
    assert detokenized(TokenizerAnswer(text="Hi")) == {"content": "Hi", "prompt": "Hi"}
    with pytest.raises(ValidationError):
        DetokenizeBody.model_validate({"tokens": [-1]})

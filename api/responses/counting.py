"""The Responses API's ``POST /v1/responses/input_tokens`` (the SDK's
``responses.input_tokens.count``), pure: a request's conversation becomes the question a runner
of the model answers (``events/tokenizer.py``, as for Anthropic's ``count_tokens`` and vLLM's
``/tokenize``), and its answer the SDK's ``InputTokenCountResponse``.

The question holds the very task a ``POST /v1/responses`` of the same body would create
(``requests.chat_task``): the instructions, the tools, the tool choice, the text format and
the thinking as the runner renders them, so the count is that response's ``input_tokens``.
"""

from __future__ import annotations

from typing import Any

from api.responses.requests import ResponsesBody, chat_task
from events.records import ChatMessage, SamplingParams
from events.tokenizer import TokenizeChat, TokenizerAnswer


def count_question(
    body: ResponsesBody, conversation: list[ChatMessage], model_id: str, origin: str
) -> TokenizeChat:
    """What the runner is asked: the count alone (a long conversation's token ids could
    outgrow a NATS message)."""
    task = chat_task(body, conversation, model_id, origin, SamplingParams())
    return TokenizeChat(task=task, count_only=True)


def input_tokens(answer: TokenizerAnswer) -> dict[str, Any]:
    """The SDK's ``InputTokenCountResponse``."""
    return {"object": "response.input_tokens", "input_tokens": answer.count}

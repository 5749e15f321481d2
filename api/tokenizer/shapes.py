"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in the shapes their clients send and
read: llama.cpp's server's and vLLM's, told apart by their fields. Pure: a body in, the question
for the model's runner out (``events/tokenizer.py``); its answer in, the response out.

- llama.cpp: ``{"content", "add_special", "parse_special", "with_pieces"}`` to ``{"tokens":
  [ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}``; ``{"tokens"}`` to ``{"content"}``.
- vLLM: ``{"model", "prompt", "add_special_tokens", "return_token_strs"}``, or ``{"model",
  "messages", "tools", "add_generation_prompt", "add_special_tokens", ...}`` with the chat
  template applied, to ``{"count", "max_model_len", "tokens", "token_strs"?}``; ``{"model",
  "tokens"}`` to ``{"prompt"}``.

Detokenizing is asked alike in both, so the answer carries both names (``content`` and
``prompt``), the same text. ``model`` may be left out in both shapes (llama.cpp's clients and
lm-evaluation-harness's remote tokenizer send none): it is then the default model, or the one
chat model served, as for a chat.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from api.body import RequestBody
from api.images.placed import NO_IMAGES, Images
from api.openai.requests import ChatCompletionRequest
from events.catalogue import TaskCreated, new_id
from events.tokenizer import Detokenize, TokenizeChat, TokenizerAnswer, TokenizeText

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class LlamaTokenize(RequestBody):
    """llama.cpp's server's ``/tokenize``."""

    model: Annotated[str, Field(min_length=1)] | None = None
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    def ask(self) -> TokenizeText:
        return TokenizeText(
            text=self.content,
            add_special=self.add_special,
            parse_special=self.parse_special,
            with_pieces=self.with_pieces,
        )


class VllmTokenizeText(RequestBody):
    """vLLM's ``/tokenize`` of a text (``TokenizeCompletionRequest``): a Hugging Face tokenizer
    reads special tokens written in the text as those tokens, so the text's are too."""

    model: Annotated[str, Field(min_length=1)] | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    def ask(self) -> TokenizeText:
        return TokenizeText(
            text=self.prompt,
            add_special=self.add_special_tokens,
            with_pieces=bool(self.return_token_strs),
        )


class VllmTokenizeChat(ChatCompletionRequest):
    """vLLM's ``/tokenize`` of a chat (``TokenizeChatRequest``): the chat's prompt as a chat
    completion of the same body would give it to the model, so its ``tools``, ``tool_choice``,
    ``response_format``, ``reasoning_effort`` and ``chat_template_kwargs`` count as they would
    there (sampling fields are read and have no effect)."""

    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    # Answer-changing fields refused (see _supported).
    continue_final_message: bool = False
    chat_template: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> VllmTokenizeChat:
        if self.continue_final_message:
            raise ValueError(
                "continue_final_message is not supported: Shoal's chats end with the model's"
                " turn to write (a prefill is not continued)"
            )
        if self.chat_template is not None:
            raise ValueError(
                "chat_template is not supported: the count is of the prompt the model's own"
                " template makes, which is what its chat tasks read"
            )
        return self

    def ask(self, model_id: str, origin: str, images: Images = NO_IMAGES) -> TokenizeChat:
        """``images``: ``image_inputs``, read (and stored: the runner reads them)."""
        task = TaskCreated(
            task_id=new_id(),
            model_id=model_id,
            origin=origin,
            kind="chat",
            messages=self.chat_messages(images),
            params=self.sampling(),
            **self.task_fields(),
        )
        return TokenizeChat(
            task=task,
            add_generation_prompt=self.add_generation_prompt,
            add_special=self.add_special_tokens,
            with_pieces=bool(self.return_token_strs),
        )


TokenizeBody = LlamaTokenize | VllmTokenizeText | VllmTokenizeChat


class DetokenizeBody(RequestBody):
    """Both shapes' ``/detokenize`` (vLLM's also names the model)."""

    model: Annotated[str, Field(min_length=1)] | None = None
    tokens: list[TokenId]

    def ask(self) -> Detokenize:
        return Detokenize(tokens=self.tokens)


class NoShape(ValueError):
    """A ``/tokenize`` body of neither shape."""


def tokenize_body(body: dict[str, Any]) -> TokenizeBody:
    """The body as the shape its fields say: ``messages`` or ``prompt`` (vLLM), ``content``
    (llama.cpp). Raises ``ValidationError`` for a body of that shape that is invalid,
    ``NoShape`` for one of no shape."""
    shape: type[BaseModel]
    if "messages" in body:
        shape = VllmTokenizeChat
    elif "prompt" in body:
        shape = VllmTokenizeText
    elif "content" in body:
        shape = LlamaTokenize
    else:
        raise NoShape(
            "send `content` (llama.cpp's shape), or `prompt` or `messages` (vLLM's): the text"
            " or the chat to tokenize"
        )
    parsed = shape.model_validate(body)
    assert isinstance(parsed, LlamaTokenize | VllmTokenizeText | VllmTokenizeChat)
    return parsed


def tokenized(body: TokenizeBody, answer: TokenizerAnswer) -> dict[str, Any]:
    """The answer in the shape of the request."""
    if isinstance(body, LlamaTokenize):
        if not body.with_pieces:
            return {"tokens": answer.tokens}
        pieces = answer.pieces or []
        return {"tokens": [p.model_dump() for p in pieces]}
    out: dict[str, Any] = {
        "count": len(answer.tokens),
        "max_model_len": answer.n_ctx,
        "tokens": answer.tokens,
    }
    if body.return_token_strs:
        out["token_strs"] = answer.vocabulary or []
    return out


def detokenized(answer: TokenizerAnswer) -> dict[str, Any]:
    """llama.cpp's ``content`` and vLLM's ``prompt``: the same text."""
    text = answer.text or ""
    return {"content": text, "prompt": text}


def invalid(exc: ValidationError) -> list[dict[str, Any]]:
    """A body's validation errors as FastAPI's, located in the body (the API's 400 names the
    field from them)."""
    return [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]

"""Questions to a model's tokenizer and their answers: what the API asks a chat runner of the
model (``events.subjects.tokenizer_subject``, core NATS request-reply, one runner of the queue
group answering), for ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and Anthropic's
``count_tokens``.

Only a runner has the tokenizer (the API holds no model), and a question changes nothing: it is
not an event, and none is stored. Request-reply rather than a task on the log: a task costs
two stored events, a consumer's delivery and a chunk subscription, a question one message each
way, and a runner answers it whether or not its slots are busy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from events.catalogue import TaskCreated


class _Ask(BaseModel):
    model_config = ConfigDict(frozen=True)


class TokenizeText(_Ask):
    """A text's tokens, as the model's tokenizer makes them."""

    kind: Literal["text"] = "text"
    text: str
    # BOS (and EOS, for a vocabulary that adds one) as the model's tokenizer adds them.
    add_special: bool = False
    # Special tokens written in the text (``<|im_start|>``) are those tokens; false: plain text.
    parse_special: bool = True
    with_pieces: bool = False


class TokenizeChat(_Ask):
    """A chat's prompt as a task of it would be given to the model: the task's messages, tools,
    tool choice, response format and thinking through the chat template, with the tool
    instructions Shoal writes for a template without tools of its own."""

    kind: Literal["chat"] = "chat"
    task: TaskCreated
    add_generation_prompt: bool = True
    # The model's BOS in front too, when the prompt does not start with it (vLLM's
    # add_special_tokens for a chat: templates write their BOS themselves).
    add_special: bool = False
    with_pieces: bool = False
    # Only how many (Anthropic's count_tokens): a long chat's ids could outgrow a message.
    count_only: bool = False


class Detokenize(_Ask):
    """Tokens back to text, special tokens spelled out."""

    kind: Literal["detokenize"] = "detokenize"
    tokens: list[int]


class DescribeTokenizer(_Ask):
    """The tokenizer's settings: its class, special tokens, the lengths, the chat template."""

    kind: Literal["info"] = "info"


TokenizerAsk = Annotated[
    TokenizeText | TokenizeChat | Detokenize | DescribeTokenizer, Field(discriminator="kind")
]


class TokenizerQuestion(BaseModel):
    """What goes on the subject: the question, in an envelope that tells its kind."""

    model_config = ConfigDict(frozen=True)

    ask: TokenizerAsk


# Why a question was not answered: the question is wrong (an unknown token, a chat the template
# rejects), its answer is larger than a NATS message may be, or the tokenizer failed.
Refusal = Literal["invalid_request", "too_large", "failed"]


class TokenPiece(BaseModel):
    """A token's text as the model writes it, special tokens spelled out: the text when its bytes
    are UTF-8, else the bytes (a token that is part of a character), as llama.cpp's server
    gives them."""

    model_config = ConfigDict(frozen=True)

    id: int
    piece: str | list[int]


class TokenizerAnswer(BaseModel):
    model_config = ConfigDict(frozen=True)

    tokens: list[int] = Field(default_factory=list)
    count: int = 0  # how many tokens (also when only the count was asked for)
    # With ``with_pieces``: each token's piece, and its spelling in the vocabulary (what
    # Hugging Face's ``convert_ids_to_tokens`` gives: ``Ġworld``).
    pieces: list[TokenPiece] | None = None
    vocabulary: list[str] | None = None
    text: str | None = None  # a detokenized text
    info: dict[str, Any] | None = None  # the tokenizer's settings
    # The context of one generation on the answering runner (vLLM's max_model_len).
    n_ctx: int = 0
    refused: Refusal | None = None
    error: str | None = None  # why, for the client

"""What the runner needs from an inference engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from inference.decoding import Decoding, Sink
from inference.generation import TokenSource
from inference.image_spans import ImagePrompt


class EngineBroken(RuntimeError):
    """The engine cannot serve any more task (a pipeline lost a stage): the runner fails the
    task it was serving, then reports Failed and exits, to be restarted."""


class Tokenizer(Protocol):
    """The model's own tokenizer, as clients may ask it (``/tokenize``, ``/detokenize``,
    ``/tokenizer_info``: ``services/runner/tokenizer_answers.py``). Safe to call from a thread
    other than the decoding one: tokenizing only reads the vocabulary."""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """``text``'s tokens: with ``add_special``, the BOS (and EOS) the vocabulary adds; with
        ``parse_special``, special tokens written in the text are those tokens, else text."""
        ...

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``, special tokens spelled out (the tokenizer's own decoding,
        as llama.cpp's server and vLLM give it). Raises ``InvalidRequest`` for a token outside
        the vocabulary."""
        ...

    def vocabulary_text(self, token: int) -> str:
        """The token as the vocabulary spells it (``Ġworld`` in a byte-level BPE)."""
        ...

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's settings, as vLLM's ``/tokenizer_info`` gives them: its class, its
        special tokens, ``model_max_length`` and the chat template, where the model has them."""
        ...


class Engine(TokenSource, Tokenizer, Protocol):
    @property
    def n_ctx(self) -> int:
        """The context of one generation."""
        ...

    @property
    def slots(self) -> int:
        """How many generations it decodes at once (the runner serves as many tasks)."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template chats are rendered with; None for a named format (or a
        model without one). Tool calls' format is chosen from it."""
        ...

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """A chat (OpenAI-shaped message dicts; an assistant's ``tool_calls`` with arguments
        as objects, as Hugging Face templates expect) through the model's chat template, with
        the generation prompt (unless not ``add_generation_prompt``), tokenized. ``tools``
        (OpenAI's ``{"type": "function", "function": ...}`` entries) are passed to the
        template, and so are ``template_kwargs`` (``enable_thinking``...). Raises
        ``InvalidRequest`` for a chat it cannot render."""
        ...

    def text_tokens(self, prompt: str) -> list[int]:
        """A plain prompt, tokenized (with the model's BOS, if it has one)."""
        ...

    @property
    def n_vocab(self) -> int: ...

    def submit(self, prompt: list[int], decoding: Decoding, sink: Sink) -> None:
        """What ``generate`` gives, handed to ``sink`` on the engine's own decoding thread
        (``engines/batch_loop.py``), the way the runner generates; the checks of ``generate``
        are made at once (``InvalidRequest``)."""
        ...


@runtime_checkable
class ReadsImages(Protocol):
    """An engine that may read a chat's images (llama.cpp with the model's projector)."""

    def images_refused(self) -> str | None:
        """Why it reads no images (a model without a projector); None: it reads them."""
        ...

    def image_chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool,
        images: Sequence[bytes],
    ) -> ImagePrompt:
        """As ``Engine.chat_tokens``, for messages whose contents hold image placeholders
        (``image_markers.py``): ``images[k]`` is the bytes of placeholder ``k``. Its tokens,
        and where its images are (``Decoding.images``)."""
        ...

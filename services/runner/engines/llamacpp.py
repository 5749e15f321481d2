"""The llama.cpp engine (llama-cpp-python), for GGUF models."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llama_cpp import Llama, llama_chat_format

from bus.events import SamplingParams, TaskCreated
from services.runner.generation import InvalidRequest

log = logging.getLogger(__name__)

# Named chat formats a model card may ask for (as llama-cpp-python names them). A model without
# one uses the chat template in its GGUF.
_FORMATTERS: dict[str, Callable[..., Any]] = {
    "gemma": llama_chat_format.format_gemma,
    "chatml": llama_chat_format.format_chatml,
    "llama-2": llama_chat_format.format_llama2,
    "llama-3": llama_chat_format.format_llama3,
    "mistral-instruct": llama_chat_format.format_mistral_instruct,
}


class LlamaCppEngine:
    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 2048,
        chat_format: str | None = None,
        n_threads: int | None = None,
        **llama_kwargs: Any,
    ) -> None:
        if chat_format is not None and chat_format not in _FORMATTERS:
            raise ValueError(
                f"unknown chat format {chat_format!r}; known: {', '.join(sorted(_FORMATTERS))}"
            )
        self._path = model_path
        self._requested_ctx = n_ctx
        self._chat_format = chat_format
        self._n_threads = n_threads or os.cpu_count() or 1
        self._kwargs = llama_kwargs
        self._llm: Llama | None = None
        self._formatter: Callable[..., Any] | None = None
        self._end_tokens: frozenset[int] = frozenset()

    def load(self) -> None:
        llm = Llama(
            model_path=str(self._path),
            n_ctx=self._requested_ctx,
            n_threads=self._n_threads,
            n_threads_batch=self._n_threads,
            verbose=False,
            **self._kwargs,
        )
        self._llm = llm
        if self._chat_format is not None:
            self._formatter = _FORMATTERS[self._chat_format]
        elif template := llm.metadata.get("tokenizer.chat_template"):
            vocab = llm._model
            self._formatter = llama_chat_format.Jinja2ChatFormatter(
                template=template,
                eos_token=vocab.token_get_text(llm.token_eos()),
                bos_token=vocab.token_get_text(llm.token_bos()),
            )
        ends = {llm.token_eos()}
        # A format's own stop marker (e.g. Gemma's <end_of_turn>) ends generation as a token.
        if self._chat_format is not None:
            stop = self._formatter(messages=[{"role": "user", "content": ""}]).stop  # type: ignore[misc]
            for s in [stop] if isinstance(stop, str) else stop or []:
                ids = llm.tokenize(s.strip().encode(), add_bos=False, special=True)
                if len(ids) == 1:
                    ends.add(ids[0])
        self._end_tokens = frozenset(ends)

    @property
    def llm(self) -> Llama:
        if self._llm is None:
            raise RuntimeError("engine not loaded")
        return self._llm

    @property
    def n_ctx(self) -> int:
        return int(self.llm.n_ctx())

    def prompt_text(self, task: TaskCreated) -> str:
        if task.kind == "completion" or task.messages is None:
            if task.prompt is None:
                raise InvalidRequest("a completion task needs a prompt")
            return task.prompt
        if self._formatter is None:
            raise InvalidRequest("this model has no chat template: send a plain prompt")
        messages = [m.model_dump(exclude_none=True) for m in task.messages]
        return str(self._formatter(messages=messages).prompt)

    def prompt_tokens(self, task: TaskCreated) -> list[int]:
        text = self.prompt_text(task)
        # Chat templates write the BOS token themselves; plain prompts get one added.
        bos = self.llm.token_bos()
        tokens: list[int] = self.llm.tokenize(text.encode(), add_bos=True, special=True)
        if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]
        return tokens

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        llm = self.llm
        llm.set_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(4)))
        return llm.generate(
            prompt,
            temp=params.temperature,
            top_p=params.top_p,
            top_k=0 if params.temperature > 0 else 40,
            min_p=0.0,
            repeat_penalty=1.0,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            reset=True,
        )

    def piece(self, token: int) -> bytes:
        return bytes(self.llm.detokenize([token]))

    def is_end(self, token: int) -> bool:
        return token in self._end_tokens

"""The llama.cpp engine (llama-cpp-python), for GGUF models.

``Llama`` loads the model and its context (it knows the RPC devices, tensor splits and threads);
the decoding is llama.cpp's low-level API: a ``llama_batch`` of the prompt in chunks of
``n_batch``, ``llama_decode``, the logits of the positions asked for, and a
``SequenceSampler`` (``llamacpp_sampling``) per sequence that picks each next token with
llama.cpp's samplers and grammars. One sequence (id 0) is decoded at a time; the batch and the
per-sequence sampler are apart so that several could share a batch.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
import numpy as np
from llama_cpp import Llama, llama_chat_format

from services.runner.decoding import Decoding, PromptScores, Token
from services.runner.engines.llamacpp_sampling import (
    GrammarCache,
    Logits,
    SequenceSampler,
    check_params,
    scored,
    seed_of,
    token_piece,
)
from services.runner.generation import InvalidRequest

# Named chat formats a model card may ask for (as llama-cpp-python names them). A model without
# one uses the chat template in its GGUF.
_FORMATTERS: dict[str, Callable[..., Any]] = {
    "gemma": llama_chat_format.format_gemma,
    "chatml": llama_chat_format.format_chatml,
    "llama-2": llama_chat_format.format_llama2,
    "llama-3": llama_chat_format.format_llama3,
    "mistral-instruct": llama_chat_format.format_mistral_instruct,
}

# A prompt that is scored (echo) needs the logits of every position; llama.cpp keeps an output
# buffer as large as the largest batch's logits for the context's life (n_batch of 512 with
# Gemma's 262k vocabulary: 512 MiB), so such prompts go in smaller chunks.
ECHO_CHUNK = 64


class _Batch:
    """A ``llama_batch``: tokens, each at a position of one sequence, with or without logits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._batch = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n = 0
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Its index in the batch (what ``llama_get_logits_ith`` takes)."""
        b, i = self._batch, self.n
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        self.n += 1
        return i

    def decode(self, ctx: Any) -> None:
        self._batch.n_tokens = self.n
        status = llama_cpp.llama_decode(ctx, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status})")


@dataclass(frozen=True)
class _Loaded:
    llm: Llama
    vocab: Any  # llama_vocab pointer
    n_vocab: int
    batch: _Batch
    grammars: GrammarCache
    formatter: Callable[..., Any] | None
    template: str | None  # the GGUF's Jinja template, when that is what chats go through
    ends: frozenset[int]


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
        self._loaded: _Loaded | None = None
        self._pieces: dict[int, bytes] = {}
        # The generation whose sequence the context holds (see ``_run``), and the tokens its
        # KV cache holds (see ``_keep``).
        self._owner: object | None = None
        self._cached: list[int] = []
        # Apply a grammar to every candidate, every token (llama.cpp's grammar_first), rather
        # than check the token picked first: for measurements.
        self.grammar_first = False

    def load(self) -> None:
        llm = Llama(
            model_path=str(self._path),
            n_ctx=self._requested_ctx,
            n_threads=self._n_threads,
            n_threads_batch=self._n_threads,
            verbose=False,
            **self._kwargs,
        )
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        formatter: Callable[..., Any] | None = None
        template: str | None = None
        if self._chat_format is not None:
            formatter = _FORMATTERS[self._chat_format]
        elif template := llm.metadata.get("tokenizer.chat_template"):
            formatter = llama_chat_format.Jinja2ChatFormatter(
                template=template,
                eos_token=_special_text(vocab, llm.token_eos()),
                bos_token=_special_text(vocab, llm.token_bos()),
            )
        # Every end-of-generation token of the vocabulary ends it, as in llama-cpp-python's
        # own completions (and a grammar, once complete, allows only these).
        ends = {llm.token_eos()}
        ends.update(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        # A format's own stop marker (e.g. Gemma's <end_of_turn>) ends generation as a token.
        if self._chat_format is not None:
            assert formatter is not None
            stop = formatter(messages=[{"role": "user", "content": ""}]).stop
            for s in [stop] if isinstance(stop, str) else stop or []:
                ids = llm.tokenize(s.strip().encode(), add_bos=False, special=True)
                if len(ids) == 1:
                    ends.add(ids[0])
        self._loaded = _Loaded(
            llm=llm, vocab=vocab, n_vocab=n_vocab,
            batch=_Batch(int(llama_cpp.llama_n_batch(llm.ctx))), grammars=GrammarCache(vocab),
            formatter=formatter, template=template or None, ends=frozenset(ends),
        )  # fmt: skip

    @property
    def loaded(self) -> _Loaded:
        if self._loaded is None:
            raise RuntimeError("engine not loaded")
        return self._loaded

    @property
    def llm(self) -> Llama:
        return self.loaded.llm

    @property
    def n_ctx(self) -> int:
        return int(self.llm.n_ctx())

    @property
    def n_vocab(self) -> int:
        return self.loaded.n_vocab

    @property
    def chat_template(self) -> str | None:
        return self.loaded.template

    # --- prompts ------------------------------------------------------------------------------

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The chat as the model reads it, before tokenizing."""
        m = self.loaded
        if m.formatter is None:
            raise InvalidRequest("this model has no chat template: send a plain prompt")
        # Named formats know nothing of tools.
        extra = {"tools": tools} if m.template is not None and tools else {}
        if self._chat_format == "gemma":
            messages = _system_in_first_user(messages)
        try:
            return str(m.formatter(messages=messages, **extra).prompt)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            # A template's raise_exception, a role or a shape it does not take.
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc

    def chat_tokens(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        return self._tokens(self.chat_text(messages, tools))

    def text_tokens(self, prompt: str) -> list[int]:
        return self._tokens(prompt)

    def _tokens(self, text: str) -> list[int]:
        # Chat templates write the BOS token themselves; plain prompts get one added.
        llm = self.llm
        bos = llm.token_bos()
        tokens: list[int] = llm.tokenize(text.encode(), add_bos=True, special=True)
        if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]
        return tokens

    # --- tokens ---------------------------------------------------------------------------------

    def piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                return b""
            # Special tokens (end of turn and the like) show no text.
            piece = self._pieces[token] = token_piece(self.loaded.vocab, token, special=False)
        return piece

    def spelled(self, token: int) -> bytes:
        return token_piece(self.loaded.vocab, token) if 0 <= token < self.n_vocab else b""

    def is_end(self, token: int) -> bool:
        return token in self.loaded.ends

    # --- generation -----------------------------------------------------------------------------

    def generate(self, prompt: list[int], decoding: Decoding) -> Iterator[Token | PromptScores]:
        """Checks the request at once (``InvalidRequest``); decodes nothing before the first
        ``next()``, and nothing more than the consumer takes. Each generation starts from an
        empty cache; one started later takes the context from this one, which then raises
        if resumed."""
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens, more than the model's context of "
                f"{self.n_ctx} tokens leaves room for"
            )
        m = self.loaded
        check_params(decoding.params, m.n_vocab, decoding.top_logprobs)
        grammar = m.grammars.get(decoding.grammar) if decoding.grammar else None
        return self._run(
            list(prompt),
            decoding,
            lambda: SequenceSampler(
                vocab=m.vocab, n_vocab=m.n_vocab, n_ctx=self.n_ctx, params=decoding.params,
                seed=seed_of(decoding.params), grammar=grammar,
                grammar_first=self.grammar_first,
            ),
        )  # fmt: skip

    def _run(
        self, prompt: list[int], decoding: Decoding, sampler: Callable[[], SequenceSampler]
    ) -> Iterator[Token | PromptScores]:
        seq = 0
        me = self._owner = object()

        def still_mine() -> None:
            if self._owner is not me:
                raise RuntimeError("a later generation took the context from this one")

        # A scored prompt needs every position's logits: it runs whole.
        kept = 0 if decoding.echo else self._keep(prompt, seq)
        picker = sampler()
        try:
            k = decoding.top_logprobs
            if decoding.echo:
                scores, last = self._prefill_scored(prompt, seq, k or 0)
                yield scores
                still_mine()
            else:
                last = self._prefill(prompt, seq, kept)
            batch, ctx, pos = self.loaded.batch, self.llm.ctx, len(prompt)
            while True:
                logits = self._logits(last)
                token = picker.sample(logits)
                yield Token(token) if k is None else scored(logits, token, k)
                if pos + 1 >= self.n_ctx:
                    return  # what is generated fits in the context, as check_request counts
                still_mine()
                batch.clear()
                last = batch.add(token, pos, seq, logits=True)
                batch.decode(ctx)
                self._cached.append(token)
                pos += 1
        finally:
            picker.close()

    def drop_cache(self) -> None:
        """Forget what the KV cache holds: the next generation runs its prompt whole (for a
        caller that used the context itself, or wants a run that does not depend on the last:
        a prompt run in pieces rounds a little differently from one run whole)."""
        self._cached = []

    def _keep(self, prompt: list[int], seq: int) -> int:
        """How much of ``prompt`` the KV cache holds already, from the last generation (a
        chat's system prompt and earlier turns), as llama-cpp-python's own ``generate`` reuses
        it; the rest of the cache is dropped. The prompt's last token always runs: its logits
        give the first token."""
        keep = 0
        for cached, token in zip(self._cached, prompt[:-1], strict=False):
            if cached != token:
                break
            keep += 1
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        if not llama_cpp.llama_memory_seq_rm(memory, seq, keep, -1):
            # A cache that cannot drop a part (a recurrent model's) is dropped whole.
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            keep = 0
        self._cached = prompt[:keep]
        return keep

    def _prefill(self, prompt: list[int], seq: int, start: int = 0) -> int:
        """Runs the prompt from ``start`` on (the cache holds the tokens before it); the batch
        index of its last position's logits."""
        batch, last = self.loaded.batch, 0
        for at in range(start, len(prompt), batch.capacity):
            batch.clear()
            chunk = prompt[at : at + batch.capacity]
            for i, token in enumerate(chunk, at):
                last = batch.add(token, i, seq, logits=i == len(prompt) - 1)
            batch.decode(self.llm.ctx)
            self._cached += chunk
        return last

    def _prefill_scored(self, prompt: list[int], seq: int, k: int) -> tuple[PromptScores, int]:
        """Runs the prompt with every position's logits: each token's score given the ones
        before it (the first has none), from the position before it."""
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)  # a whole sequence: never fails
        self._cached = []
        batch, last = self.loaded.batch, 0
        tokens = [Token(prompt[0])]
        size = min(ECHO_CHUNK, batch.capacity)
        for start in range(0, len(prompt), size):
            batch.clear()
            chunk = prompt[start : start + size]
            for i, token in enumerate(chunk, start):
                last = batch.add(token, i, seq, logits=True)
            batch.decode(self.llm.ctx)
            self._cached += chunk
            for j in range(len(chunk)):
                if start + j + 1 < len(prompt):
                    tokens.append(scored(self._logits(j), prompt[start + j + 1], k))
        return PromptScores(tuple(tokens)), last

    def _logits(self, index: int) -> Logits:
        """A view of the logits the last decode gave at batch ``index`` (valid until the next
        decode)."""
        pointer = llama_cpp.llama_get_logits_ith(self.llm.ctx, index)
        if not pointer:
            raise RuntimeError(f"no logits at batch index {index}")
        logits: Logits = np.ctypeslib.as_array(pointer, shape=(self.loaded.n_vocab,))
        return logits


def _system_in_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-cpp-python's ``gemma`` format drops system messages (Gemma has no such role):
    their text goes at the start of the first user message instead, as Gemma's own template
    does."""
    system = "\n\n".join(str(m.get("content") or "") for m in messages if m["role"] == "system")
    rest = [m for m in messages if m["role"] != "system"]
    if not system:
        return rest
    for i, m in enumerate(rest):
        if m["role"] == "user":
            rest[i] = m | {"content": f"{system}\n\n{m.get('content') or ''}"}
            return rest
    return [{"role": "user", "content": system}, *rest]


def _special_text(vocab: Any, token: int) -> str:
    """A special token's text, for templates (``{{ bos_token }}``)."""
    if token < 0:
        return ""
    return bytes(llama_cpp.llama_vocab_get_text(vocab, token)).decode(errors="replace")

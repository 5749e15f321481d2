"""The llama.cpp engine in embedding mode (llama-cpp-python), for an embed instance's runners.

The context is made by ``Llama(embedding=True)`` with the model's own pooling (mean, CLS or
last token, from the GGUF's ``<arch>.pooling_type``); a generative model has none, and is
mean-pooled. Inputs are computed as ``Llama.embed`` does: as many sequences as fit in one
``llama_decode`` (``n_batch`` tokens, ``n_seq_max`` sequences), each with its own sequence
id, the memory cleared between batches. ``Llama.embed`` itself takes only text, cuts a long
input short in silence (or raises a bare ``ValueError``), and returns Python lists; this one
takes token ids, says which input is too long, and fills one numpy array. A reranker's
engine (``rerank.py``) is this one with rank pooling: one score per sequence, not a vector.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama

from events.vectors import Vectors
from inference.engines.llamacpp.batch import Batch
from modelfiles.gguf_header import read_gguf_fields
from structured.reply import InvalidRequest

POOLING_NAMES = {
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
}
RANK = "rank"


def pooling_of(fields: dict[str, Any]) -> int:
    """The pooling a GGUF's header asks for; mean for a model without one (a generative
    model: its per-token states averaged). A reranker's (``rank``) gives scores, not
    vectors: refused."""
    arch = fields.get("general.architecture", "")
    value = fields.get(f"{arch}.pooling_type")
    if value is None or value in (
        llama_cpp.LLAMA_POOLING_TYPE_NONE,
        llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED,
    ):
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    if value not in POOLING_NAMES:
        raise ValueError(
            f"the model's pooling type {value} gives no embedding (a reranker? serve it with"
            " role rerank)"
        )
    return int(value)


class LlamaCppEmbedder:
    # What the instance serves, for the messages that refuse an input.
    serves = "embed"

    def __init__(
        self, model_path: Path, *, n_ctx: int = 512, n_threads: int | None = None, **kwargs: Any
    ) -> None:
        self._path = model_path
        self._requested_ctx = n_ctx
        self._n_threads = n_threads or os.cpu_count() or 1
        self._kwargs = kwargs
        self._llm: Llama | None = None
        self._batch: Batch | None = None
        self.pooling = "mean"

    def pooling_for(self, fields: dict[str, Any]) -> int:
        """The pooling the context is made with, from the GGUF's header (``ValueError``: a
        model this engine cannot serve)."""
        return pooling_of(fields)

    def load(self) -> None:
        pooling = self.pooling_for(read_gguf_fields(self._path))
        # One batch holds a whole input (a non-causal model's must be in one micro-batch),
        # and as many short ones as fit: batch and micro-batch are the context. Flash
        # attention: without it, a sequence's vector depends on where it sits in the batch
        # (up to 4e-3 a component for SmolLM2); with it, batched is one by one within 1e-7.
        kwargs: dict[str, Any] = {"flash_attn": True, **self._kwargs}
        llm = Llama(
            model_path=str(self._path),
            embedding=True,
            pooling_type=pooling,
            n_ctx=self._requested_ctx,
            n_batch=self._requested_ctx,
            n_ubatch=self._requested_ctx,
            n_threads=self._n_threads,
            n_threads_batch=self._n_threads,
            verbose=False,
            **kwargs,
        )
        self._llm = llm
        self._batch = Batch(llm.n_batch)
        self.pooling = POOLING_NAMES.get(pooling, RANK)

    @property
    def llm(self) -> Llama:
        if self._llm is None:
            raise RuntimeError("engine not loaded")
        return self._llm

    @property
    def n_ctx(self) -> int:
        """The longest input, in tokens."""
        return min(int(self.llm.n_ctx()), self.llm.n_batch)

    @property
    def n_embd(self) -> int:
        return int(self.llm.n_embd())

    @property
    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    @property
    def n_seq_max(self) -> int:
        return int(self.llm.context_params.n_seq_max)

    def text_tokens(self, text: str) -> list[int]:
        """A text as the model reads it for an embedding, with the special tokens its
        tokenizer adds (BERT's [CLS] and [SEP], a BOS), as ``Llama.embed`` tokenizes."""
        tokens: list[int] = self.llm.tokenize(text.encode(), add_bos=True, special=False)
        return tokens

    def embed(self, inputs: Sequence[Sequence[int]]) -> Vectors:
        """The inputs' vectors, L2-normalised, one row each, in order."""
        out = self.pooled(inputs, self.n_embd)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out /= np.where(norms > 0, norms, np.float32(1.0))
        return out

    def pooled(self, inputs: Sequence[Sequence[int]], width: int) -> Vectors:
        """What the pooling gives for each input (``width`` floats: a vector, or a reranker's
        scores), one row each, in order."""
        batch = self._batch
        assert batch is not None
        limit = self.n_ctx
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise InvalidRequest(f"input {i} is empty")
            if len(tokens) > limit:
                raise InvalidRequest(
                    f"input {i} has {len(tokens)} tokens, more than the {limit} this"
                    f" {self.serves} instance takes (request one with a larger context_length)"
                )
        out = np.empty((len(inputs), width), dtype=np.float32)
        rows: list[int] = []  # the input of each sequence of the batch being filled
        batch.clear()
        for i, tokens in enumerate(inputs):
            if rows and (batch.n + len(tokens) > batch.capacity or len(rows) >= self.n_seq_max):
                self._decode(rows, out)
                rows = []
            for pos, token in enumerate(tokens):
                batch.add(token, pos, len(rows), logits=True)  # every token is an output
            rows.append(i)
        if rows:
            self._decode(rows, out)
        return out

    def _decode(self, rows: list[int], out: Vectors) -> None:
        """Run the batch (sequence ``s`` is input ``rows[s]``) into ``out``."""
        llm, batch = self.llm, self._batch
        assert batch is not None
        memory = llama_cpp.llama_get_memory(llm.ctx)
        if memory:  # a non-causal model may have none
            llama_cpp.llama_memory_clear(memory, True)
        batch.decode(llm.ctx)
        batch.clear()
        width = out.shape[1]
        for seq, row in enumerate(rows):
            pointer = llama_cpp.llama_get_embeddings_seq(llm.ctx, seq)
            if not pointer:
                raise RuntimeError(f"no output for sequence {seq}")
            out[row] = np.ctypeslib.as_array(pointer, shape=(width,))

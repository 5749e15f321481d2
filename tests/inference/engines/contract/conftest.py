"""The engines the contract suite runs over, each loaded once per module: ``engine_kind`` is
llama.cpp (SmolLM2-135M-Instruct's GGUF) or MLX (the tiny random-weight model); ``engine``
serves one generation at a time, ``batched`` several at once, ``two_slots`` two (a test of
its own, for the slots it fills); ``reference`` is the model's own log-softmax over a
sequence, computed apart from the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from llama_cpp import Llama

from inference.engines.base import Engine
from inference.engines.llamacpp.batch_plan import ECHO_CHUNK
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.engines.mlx.engine import MlxEngine
from tests.inference.engines.conftest import SMOLLM2_GGUF

KINDS = ("llamacpp", "mlx")
BATCH = 5  # the batched engine's slots: as many as a test runs generations at once
# The log-softmax of a sequence's rows (row i: the distribution of the token after position
# i): the prompt's positions, then those of the generated tokens.
Reference = Callable[[Sequence[int], Sequence[int]], npt.NDArray[np.float64]]


def make(kind: str, request: pytest.FixtureRequest, n_ctx: int = 1024, slots: int = 1) -> Engine:
    """A loaded engine of ``kind``'s model (one thread for llama.cpp: a sum split differently
    rounds differently)."""
    engine: LlamaCppEngine | MlxEngine
    if kind == "llamacpp":
        engine = LlamaCppEngine(SMOLLM2_GGUF, n_ctx=n_ctx, slots=slots, n_threads=1)
    else:
        engine = MlxEngine(request.getfixturevalue("tiny_mlx"), n_ctx=n_ctx, slots=slots)
    engine.load()
    return engine


def close(engine: Engine) -> None:
    assert isinstance(engine, LlamaCppEngine | MlxEngine)
    engine.close()


@pytest.fixture(scope="module", params=KINDS)
def engine_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(engine_kind: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    made = make(engine_kind, request)
    yield made
    close(made)


@pytest.fixture(scope="module")
def batched(engine_kind: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    made = make(engine_kind, request, slots=BATCH)
    yield made
    close(made)


@pytest.fixture
def two_slots(engine_kind: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    made = make(engine_kind, request, slots=2)
    yield made
    close(made)


def log_softmax(rows: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    peak = rows.max(axis=1, keepdims=True)
    out: npt.NDArray[np.float64] = rows - peak - np.log(np.exp(rows - peak).sum(axis=1))[:, None]
    return out


@pytest.fixture(scope="module")
def reference(engine_kind: str, request: pytest.FixtureRequest) -> Reference:
    """llama.cpp: llama-cpp-python keeping every position's logits, as the engine computes
    (flash attention on, a prompt in chunks of ``ECHO_CHUNK``: flash attention rounds
    differently for other shapes; the prompt in one batch, then the generated tokens one at a
    time, as a generation runs them). MLX: the model over the whole sequence in one pass."""
    if engine_kind == "llamacpp":
        llm = Llama(
            model_path=str(SMOLLM2_GGUF),
            n_ctx=1024,
            n_batch=ECHO_CHUNK,
            n_ubatch=ECHO_CHUNK,
            n_threads=1,
            n_threads_batch=1,
            logits_all=True,
            flash_attn=True,
            verbose=False,
        )

        def llama_rows(prompt: Sequence[int], generated: Sequence[int]) -> npt.NDArray[np.float64]:
            llm.reset()  # type: ignore[no-untyped-call]
            llm.eval(list(prompt))
            for token in generated:
                llm.eval([token])
            n = len(prompt) + len(generated)
            return log_softmax(np.array(llm.scores[:n], dtype=np.float64))

        return llama_rows
    model = request.getfixturevalue("engine")
    assert isinstance(model, MlxEngine)

    def mlx_rows(prompt: Sequence[int], generated: Sequence[int]) -> npt.NDArray[np.float64]:
        logits = model.model(mx.array([[*prompt, *generated]]))[0].astype(mx.float32)
        return log_softmax(np.array(logits, dtype=np.float64))

    return mlx_rows

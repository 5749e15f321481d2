"""A thinking budget on every engine (llama.cpp; MLX one task at a time and batched): once the
thinking has spent it, the runner makes the model write ``\\n</think>\\n\\n`` and the answer
follows. On SmolLM2 with R1's kind of template (its generation prompt opens the thinking, and
asked without earlier turns that show it how, the 135M model never closes it) and Qwen3's
(hermes tool calls after the thinking, constrained)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.catalogue import TaskCreated
from events.records import SamplingParams, ToolChoice
from harness.models.templated import QWEN3, WithTemplate, mlx_with_template
from inference.engines.base import Engine
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.engines.mlx.engine import MlxEngine
from inference.generation import Step, check_request, steps
from inference.job import CLOSE, prepare
from tests.inference.test_thinking import R1, SHOTS, WEATHER, task, user

BUDGET = 8


@pytest.fixture(scope="module", params=["llamacpp", "mlx", "mlx-batched"])
def engines(
    request: pytest.FixtureRequest,
    smollm2_with_template: WithTemplate,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Engine]]:
    """The engine with R1's template and with Qwen3's."""
    made: dict[str, LlamaCppEngine | MlxEngine] = {}
    if request.param == "llamacpp":
        for name, template in (("r1", R1), ("qwen3", QWEN3)):
            made[name] = LlamaCppEngine(smollm2_with_template(template), n_ctx=1024, n_threads=1)
    else:
        smollm2_mlx: Path = request.getfixturevalue("smollm2_mlx")
        slots = 2 if request.param == "mlx-batched" else 1
        folder = tmp_path_factory.mktemp("templated_mlx")
        for name, template in (("r1", R1), ("qwen3", QWEN3)):
            path = mlx_with_template(smollm2_mlx, folder / name, template)
            made[name] = MlxEngine(path, n_ctx=1024, slots=slots)
    for engine in made.values():
        engine.load()
    yield dict(made)
    for engine in made.values():
        engine.close()
    if request.param != "llamacpp":
        shutil.rmtree(folder, ignore_errors=True)


def serve(engine: Engine, t: TaskCreated) -> tuple[list[Step], str, str]:
    """The steps, the thinking and the answer."""
    job = prepare(engine, t)
    limit = check_request(len(job.prompt), t.params, engine.n_ctx)
    made = steps(engine, job.prompt, job.decoding, limit, lambda: False, job.reply)
    out = [s for s in made if isinstance(s, Step)]
    return out, "".join(s.reasoning for s in out), "".join(s.text for s in out)


def closing(engine: Engine) -> list[int]:
    return engine.tokenize(CLOSE, add_special=False, parse_special=True)


def test_a_spent_budget_ends_the_thinking_and_the_answer_follows(
    engines: dict[str, Engine],
) -> None:
    r1 = engines["r1"]
    ask = [user("Explain how a bicycle works.")]
    # Room for the budget, the tag and a few tokens of answer: fewer steps on CPU MLX.
    short = SamplingParams(temperature=0, max_tokens=24)
    free, free_thinking, _ = serve(r1, task(ask, params=short))
    # Unbounded, the model thinks past the budget (to the end of its tokens, on llama.cpp).
    assert free[-1].reasoning_tokens > BUDGET + len(closing(r1)), free_thinking
    out, thinking, said = serve(r1, task(ask, params=short, thinking_budget=BUDGET))
    tokens = [s.token_id for s in out if s.token_id is not None]
    close = closing(r1)
    at = next(i for i in range(len(tokens)) if tokens[i : i + len(close)] == close)
    # Forced once the budget is spent: at once, or a few tokens late where the engine samples
    # ahead of the steps (MLX's batch).
    assert BUDGET <= at <= BUDGET + 3, (at, tokens)
    # The thinking's tokens: the budget and the tag ("\n</think>": the blank line after it is
    # the answer's).
    tag = len(r1.tokenize(CLOSE.rstrip(), add_special=False, parse_special=True))
    assert out[-1].reasoning_tokens == at + tag
    assert thinking and "</think>" not in thinking + said
    assert said or out[-1].finish_reason == "stop", (thinking, said, out[-1])
    # Before the budget, the same tokens as unbounded; a budget not reached changes nothing.
    assert tokens[:BUDGET] == [s.token_id for s in free[:BUDGET]]
    roomy, _, _ = serve(r1, task(ask, params=short, thinking_budget=1000))
    assert [s.token_id for s in roomy] == [s.token_id for s in free]
    print(f"{type(r1).__name__}: reasoning {out[-1].reasoning_tokens} tokens, answer {said!r}")


def test_a_required_call_still_follows_a_spent_budget(engines: dict[str, Engine]) -> None:
    # The grammar holds the thinking, then the call: the forced tag is what it allows.
    chat = [*SHOTS, user("What is the weather in Paris?")]
    required = task(
        chat,
        tools=[WEATHER],
        tool_choice=ToolChoice(mode="required"),
        # One call: the reply ends once it is whole, not at a repeat (fewer steps on CPU MLX).
        parallel_tool_calls=False,
        params=SamplingParams(temperature=0, max_tokens=80),
        thinking_budget=4,
    )
    out, thinking, said = serve(engines["qwen3"], required)
    assert out[-1].finish_reason == "tool_calls", (thinking, said)
    calls = [d for s in out for d in s.tool_calls]
    assert calls[0].name == "get_weather"
    assert isinstance(json.loads("".join(d.arguments for d in calls))["city"], str)
    assert out[-1].reasoning_tokens <= 4 + 3 + len(closing(engines["qwen3"]))
    # A lazy grammar (auto) fires after the forced tag as after the model's own.
    auto = required.model_copy(
        update={
            "tool_choice": ToolChoice(mode="auto"),
            "params": SamplingParams(temperature=0, max_tokens=24),
        }
    )
    out, thinking, said = serve(engines["qwen3"], auto)
    assert "<tool_call>" not in said and "</think>" not in said, said

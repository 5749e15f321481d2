"""A repeated tool call ends the reply, on both engines, with the real SmolLM2: allowed several
calls (``tool_choice`` required, ``parallel_tool_calls`` by default), the 135M model writes the
same call again and again until ``max_tokens``. Through the runner's own path (``prepare``,
the engine, ``steps``): the reply ends ``tool_calls`` at the repeat, its calls distinct, and the
engine is asked for no token after it.

One tool, whose ``unit`` the model varies: it calls it for Paris in celsius, then in
fahrenheit (same name, other arguments: held until whole, then let through), then writes one of
those again (both engines, about 90 tokens). MLX on a CPU costs a tenth to a fifth of a second
per token of the prompt, more per token written, so the prompt is kept short (191 tokens; the
weather and time tools of ``tests/api/asks.py`` made it 252); ``max_tokens`` leaves room for a
fourth call, which a reply that went on past the repeat would be writing.
"""

from __future__ import annotations

import json

import pytest

import tests.api.asks as asks
from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams, Tool, ToolChoice
from inference.engines.base import Engine
from inference.generation import Step, check_request, steps
from inference.job import prepare
from structured.repeats import first_repeat
from tests.inference.engines.conftest import SMOLLM2_GGUF

pytestmark = pytest.mark.slow

MAX_TOKENS = 120  # the reply ends at about 90
WEATHER = Tool(
    name=asks.WEATHER_NAME,
    description=asks.WEATHER_DESCRIPTION,
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
)
REQUIRED = TaskCreated(
    task_id="t",
    model_id="m",
    origin="test",
    messages=[ChatMessage(role="user", content=asks.WEATHER_QUESTION)],
    tools=[WEATHER],
    tool_choice=ToolChoice(mode="required"),
    params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
)


@pytest.fixture(scope="module")
def smollm2(engine_kind: str, request: pytest.FixtureRequest) -> Engine:
    """SmolLM2 on every engine: its GGUF, converted for MLX (a random model writes no call)."""
    engine: Engine
    if engine_kind == "llamacpp":
        from inference.engines.llamacpp.engine import LlamaCppEngine

        engine = LlamaCppEngine(SMOLLM2_GGUF, n_ctx=1024, n_threads=2)
    else:
        from inference.engines.mlx.engine import MlxEngine

        engine = MlxEngine(request.getfixturevalue("smollm2_mlx"), n_ctx=1024)
    engine.load()
    return engine


def _written(engine: Engine, made: list[Step]) -> str:
    """The generated tokens' text, as the model wrote it."""
    return b"".join(engine.spelled(s.token_id) for s in made if s.token_id is not None).decode()


@pytest.mark.timeout(600)
def test_a_repeated_call_ends_the_reply_with_tool_calls(smollm2: Engine) -> None:
    job = prepare(smollm2, REQUIRED)
    limit = check_request(len(job.prompt), REQUIRED.params, smollm2.n_ctx)
    made = [
        s
        for s in steps(smollm2, job.prompt, job.decoding, limit, lambda: False, job.reply)
        if isinstance(s, Step)
    ]
    last = made[-1]
    assert last.finish_reason == "tool_calls"
    calls: dict[int, list[str]] = {}
    for d in (d for s in made for d in s.tool_calls):
        call = calls.setdefault(d.index, ["", ""])
        call[0] += d.name or ""
        call[1] += d.arguments
    pairs = [(name, arguments) for name, arguments in calls.values()]
    assert pairs and first_repeat(pairs) is None, pairs
    for name, arguments in pairs:
        assert name == asks.WEATHER_NAME and isinstance(json.loads(arguments), dict)
    # The defect, reproduced and stopped: what the model wrote holds one more call, identical
    # to one of those, which ended the reply well before max_tokens.
    written = json.loads(_written(smollm2, made) + "]}")
    wrote = [(c["name"], json.dumps(c["arguments"])) for c in written["tool_calls"]]
    assert first_repeat(wrote) == len(pairs) == len(wrote) - 1, wrote
    assert len(made) - 1 < MAX_TOKENS

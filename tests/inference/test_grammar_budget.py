"""Schema bombs (issue 54, finding 3): a schema's size, properties and nesting are bounded, and
so are a request's schemas together (400s naming the field, structured/schema_checks.py and
schema.py); and a task's grammar is built off the runner's event loop within a time budget
(inference/job.py: ``prepared``): one that takes longer fails alone while the loop goes
on serving. On the real model and llama-cpp-python's converter."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams, Tool
from harness.models.templated import SMOLLM2
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.job import prepared
from structured.reply import InvalidRequest
from structured.schema import MAX_PROPERTIES
from structured.schema_checks import (
    MAX_SCHEMA_BYTES,
    MAX_TOTAL_PROPERTIES,
    schema_problem,
    schemas_problem,
)


def _optional(n: int, nested: int = 0) -> dict[str, Any]:
    """An object of ``n`` optional properties (the converter's cubic case), each an object
    of ``nested`` optional properties when given."""
    leaf: dict[str, Any] = {"type": "string"}
    if nested:
        leaf = {
            "type": "object",
            "properties": {f"q{i}": {"type": "integer"} for i in range(nested)},
        }
    return {"type": "object", "properties": {f"p{i}": leaf for i in range(n)}}


def test_a_schema_is_bounded_in_properties_size_and_nesting() -> None:
    assert schema_problem(_optional(MAX_PROPERTIES)) is None
    too_many = schema_problem(_optional(MAX_PROPERTIES + 1))
    assert too_many is not None and f"more than the {MAX_PROPERTIES}" in too_many
    wide = {"type": "object", "properties": {"a": {"enum": ["x" * 1000] * 70}}}
    too_large = schema_problem(wide)
    assert too_large is not None and f"more than the {MAX_SCHEMA_BYTES}" in too_large
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    assert "nests too deeply" in str(schema_problem(deep))


def test_a_requests_schemas_are_bounded_together_naming_the_one_past_it() -> None:
    tools = {f"tools.{i}.parameters": _optional(200) for i in range(10)}
    assert schemas_problem(tools) is None
    tools["tools.10.parameters"] = _optional(200)
    found = schemas_problem(tools)
    assert found is not None and found[0] == "tools.10.parameters"
    assert f"more than {MAX_TOTAL_PROPERTIES} properties" in found[1]


@pytest.fixture(scope="module")
def engine() -> LlamaCppEngine:
    loaded = LlamaCppEngine(SMOLLM2, n_ctx=512, n_threads=1)
    loaded.load()
    return loaded


def _task(tools: list[Tool]) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content="Hi")],
        tools=tools,
        params=SamplingParams(max_tokens=4),
    )


async def test_a_grammar_past_its_budget_fails_alone_and_the_loop_goes_on(
    engine: LlamaCppEngine,
) -> None:
    """Once, 128 tools of objects of 600-800 optional properties froze a runner's loop (no
    chunks, heartbeats or claims for any of its tasks) for minutes."""
    bomb = [Tool(name=f"f{i}", parameters=_optional(16, nested=16)) for i in range(7)]
    beats = 0

    async def beat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0.005)

    ticker = asyncio.create_task(beat())
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"took more than 0.01 s to become a grammar"):
        await prepared(engine, _task(bomb), budget_s=0.01)
    ticker.cancel()
    assert beats >= 1 and time.monotonic() - started < 5
    job = await prepared(engine, _task(bomb[:1]))  # within the budget: a grammar
    assert job.decoding.grammar is not None

"""OpenAI request bodies into task fields: pure translation."""

from __future__ import annotations

from api.openai.requests import ChatCompletionRequest, CompletionRequest, choice_params
from events.records import SamplingParams, ToolChoice

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def test_each_choice_has_its_own_seed() -> None:
    seeded = SamplingParams(seed=7)
    assert [choice_params(seeded, i).seed for i in range(3)] == [7, 8, 9]
    unseeded = SamplingParams()
    assert all(choice_params(unseeded, i).seed is None for i in range(3))


def test_tool_choice_defaults_to_auto_with_tools_and_none_without() -> None:
    assert chat(tools=[TOOL]).task_fields()["tool_choice"] == ToolChoice(mode="auto")
    assert chat().task_fields()["tool_choice"] == ToolChoice(mode="none")
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.task_fields()["tool_choice"] == ToolChoice(mode="function", name="f")
    assert (
        chat(tools=[TOOL], parallel_tool_calls=False).task_fields()["parallel_tool_calls"] is False
    )


def test_logprobs_are_the_number_of_alternatives_or_none() -> None:
    assert chat().task_fields()["logprobs"] is None
    assert chat(logprobs=True).task_fields()["logprobs"] == 0
    assert chat(logprobs=True, top_logprobs=5).task_fields()["logprobs"] == 5
    assert chat(logprobs=False).task_fields()["logprobs"] is None


def test_a_completion_scores_its_prompt_only_when_that_is_needed() -> None:
    def fields(**body: object) -> dict[str, object]:
        return CompletionRequest.model_validate({"model": "m", **body}).task_fields()

    assert fields(prompt="x", echo=True)["echo"] is False  # the text is the request's own
    assert fields(prompt="x", echo=True, logprobs=1)["echo"] is True
    assert fields(prompt=[1, 2], echo=True)["echo"] is True  # the ids' text comes from scores
    assert fields(prompt="x", logprobs=1)["echo"] is False


def test_sampling_extensions_reach_the_task() -> None:
    params = chat(top_k=40, min_p=0.05, repeat_penalty=1.1, logit_bias={"42": -100}).sampling()
    assert (params.top_k, params.min_p, params.repeat_penalty) == (40, 0.05, 1.1)
    assert params.logit_bias == {42: -100.0}

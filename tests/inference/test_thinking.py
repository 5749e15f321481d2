"""A thinking model through the runner's own path (``prepare``, the engine, ``steps``): SmolLM2
in GGUF copies with thinking templates (R1's kind, whose generation prompt opens the thinking;
Qwen3's, with its ``enable_thinking`` switch and hermes tool calls). The 135M model thinks in
``<think>`` when an earlier turn in the chat shows it how."""

from __future__ import annotations

import json

import pytest

from events.catalogue import TaskCreated
from events.records import ChatMessage, ResponseFormat, SamplingParams, Tool, ToolChoice
from harness.models.templated import QWEN3, WithTemplate
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.generation import Step, check_request, steps
from inference.job import prepare

# R1's kind: the generation prompt opens the thinking; an earlier answer's thinking is cut
# out of it (what is before </think>), and reasoning_content is not read.
R1 = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1] | trim }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def answer(thought: str, text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text, reasoning=thought)


# Earlier turns that show the model how it thinks.
SHOTS = [
    user("What is 1 + 1?"),
    answer("One and one make two.", "2."),
    user("What is 3 + 3?"),
    answer("Three and three make six.", "6."),
]


@pytest.fixture(scope="module")
def r1(smollm2_with_template: WithTemplate) -> LlamaCppEngine:
    engine = LlamaCppEngine(smollm2_with_template(R1), n_ctx=1024, n_threads=1)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def qwen3(smollm2_with_template: WithTemplate) -> LlamaCppEngine:
    engine = LlamaCppEngine(smollm2_with_template(QWEN3), n_ctx=1024, n_threads=1)
    engine.load()
    return engine


def task(messages: list[ChatMessage], **fields: object) -> TaskCreated:
    return TaskCreated.model_validate(
        {
            "task_id": "t",
            "model_id": "m",
            "origin": "test",
            "messages": messages,
            "params": SamplingParams(temperature=0, max_tokens=48),
            **fields,
        }
    )


def serve(engine: LlamaCppEngine, t: TaskCreated) -> tuple[list[Step], str, str]:
    """The steps, the thinking and the answer."""
    job = prepare(engine, t)
    limit = check_request(len(job.prompt), t.params, engine.n_ctx)
    made = steps(engine, job.prompt, job.decoding, limit, lambda: False, job.reply)
    out = [s for s in made if isinstance(s, Step)]
    return out, "".join(s.reasoning for s in out), "".join(s.text for s in out)


def test_a_prompt_that_opens_the_thinking_starts_the_reply_in_it(r1: LlamaCppEngine) -> None:
    # No earlier turn shows it: the model ends without closing its thinking, which is all
    # of the reply.
    _, thinking, said = serve(r1, task([user("What is 2 + 2?")]))
    assert thinking and said == "" and "<think>" not in thinking


def test_an_earlier_thinking_goes_to_the_template_which_keeps_or_drops_it(
    r1: LlamaCppEngine, qwen3: LlamaCppEngine
) -> None:
    chat = [*SHOTS, user("What is 2 + 2?")]
    assert "One and one" in qwen3.llm.detokenize(prepare(qwen3, task(chat)).prompt).decode()
    assert "One and one" not in r1.llm.detokenize(prepare(r1, task(chat)).prompt).decode()


def test_the_templates_switch_turns_the_thinking_off(qwen3: LlamaCppEngine) -> None:
    chat = [*SHOTS, user("What is 2 + 2?")]
    _, thinking, said = serve(qwen3, task(chat))
    assert thinking and said, (thinking, said)
    off = prepare(qwen3, task(chat, thinking=False))
    assert qwen3.llm.detokenize(off.prompt).decode().endswith("<think>\n\n</think>\n\n")
    _, thinking, said = serve(qwen3, task(chat, thinking=False))
    assert thinking == "" and said


WEATHER = Tool(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def test_a_call_after_the_thinking_is_parsed_and_constrained(qwen3: LlamaCppEngine) -> None:
    chat = [*SHOTS, user("What is the weather in Paris?")]
    required = task(
        chat,
        tools=[WEATHER],
        tool_choice=ToolChoice(mode="required"),
        params=SamplingParams(temperature=0, max_tokens=120),
    )
    out, thinking, said = serve(qwen3, required)
    assert out[-1].finish_reason == "tool_calls", (thinking, said)
    calls = [d for s in out for d in s.tool_calls]
    assert calls[0].name == "get_weather"
    assert isinstance(json.loads("".join(d.arguments for d in calls))["city"], str)
    assert "<tool_call>" not in said


def test_structured_output_after_the_thinking(qwen3: LlamaCppEngine) -> None:
    chat = [*SHOTS, user("What is 2 + 2?")]
    shaped = task(chat, response_format=ResponseFormat(type="json_object"))
    _, thinking, said = serve(qwen3, shaped)
    assert isinstance(json.loads(said), dict), (thinking, said)

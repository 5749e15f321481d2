"""A thinking model end to end, through each dialect's own SDK, unchanged: SmolLM2 in a GGUF copy
whose chat template thinks (its generation prompt opens ``<think>``, as R1's does, and
``enable_thinking`` false closes it, as Qwen3's switch does; an earlier answer's
``reasoning_content`` is written back), added to the session's `shoal up` and served by a
runner of its own. The earlier turns each dialect sends back show the 135M model how to think:
so each dialect's way of sending a thinking back is tested too."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from harness.models.templated import WithTemplate
from harness.processes import SHOAL
from tests.api.up_cluster import UpCluster

pytestmark = pytest.mark.slow

MODEL = "smol-thinks"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# (question, thinking, answer) of the earlier turns, and the question asked.
SHOTS = [
    ("What is 1 + 1?", "One and one make two.", "2."),
    ("What is 3 + 3?", "Three and three make six.", "6."),
]
ASK = "What is 2 + 2?"
GREEDY = {"temperature": 0}  # not a parameter of this Anthropic SDK's methods


@pytest.fixture(scope="module")
def thinks(up_cluster: UpCluster, smollm2_with_template: WithTemplate) -> Iterator[UpCluster]:
    """The session's cluster, serving the thinking copy too."""
    path = smollm2_with_template(TEMPLATE)
    added = subprocess.run(
        [
            SHOAL,
            "models",
            "add",
            MODEL,
            "--path",
            str(path),
            "--bucket",
            "--nats",
            up_cluster.nats_url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert added.returncode == 0, added.stdout + added.stderr
    headers = {"Authorization": f"Bearer {up_cluster.key}"}

    async def serving() -> None:
        # A request for a model whose instance is loading waits for it (loading on demand),
        # longer than httpx's 5 s on a busy machine.
        async with httpx.AsyncClient(
            base_url=up_cluster.base, headers=headers, timeout=240
        ) as client:
            asked = await client.post("/v1/instances", json={"model": MODEL, "slots": 1})
            assert asked.status_code == 202, asked.text
            ask = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "?"}]}
            async with asyncio.timeout(240):
                while (r := await client.post("/v1/chat/completions", json=ask)).status_code != 200:
                    assert r.status_code == 503, r.text  # placed, loading
                    await asyncio.sleep(0.5)

    asyncio.run(serving())
    yield up_cluster


def test_openai_reasoning_content(thinks: UpCluster) -> None:
    client = openai.OpenAI(base_url=f"{thinks.base}/v1", api_key=thinks.key)
    history: list[Any] = []
    for question, thought, said in SHOTS:
        history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": said, "reasoning_content": thought},
        ]
    messages = [*history, {"role": "user", "content": ASK}]
    made = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40
    )
    message = made.choices[0].message
    thinking = (message.model_extra or {}).get("reasoning_content")
    assert thinking and message.content, message
    assert "</think>" not in thinking + message.content
    # The thinking's tokens, its tags included, are counted among the completion's.
    assert made.usage is not None and made.usage.completion_tokens_details is not None
    reasoning = made.usage.completion_tokens_details.reasoning_tokens
    assert reasoning is not None and 0 < reasoning < made.usage.completion_tokens
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40, stream=True
    )
    pieces = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in pieces) == thinking
    assert "".join(d.content or "" for d in pieces) == message.content
    # Turned off: the template's switch closes the thinking in the prompt.
    off = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40, reasoning_effort="none"
    )
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert off.choices[0].message.content
    assert off.usage is not None and off.usage.completion_tokens_details is not None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_anthropic_thinking_blocks(thinks: UpCluster) -> None:
    client = anthropic.Anthropic(base_url=thinks.base, api_key=thinks.key)
    history: list[Any] = []
    for question, thought, said in SHOTS:
        history += [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": thought, "signature": "s"},
                    {"type": "text", "text": said},
                ],
            },
        ]
    messages = [*history, {"role": "user", "content": ASK}]
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    made = client.messages.create(
        model=MODEL, max_tokens=40, messages=messages, extra_body=GREEDY, thinking=thinking
    )
    assert [b.type for b in made.content] == ["thinking", "text"], made.content
    assert made.content[0].type == "thinking" and made.content[0].thinking
    with client.messages.stream(
        model=MODEL, max_tokens=40, messages=messages, extra_body=GREEDY, thinking=thinking
    ) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in made.content]
    plain = client.messages.create(model=MODEL, max_tokens=40, messages=messages, extra_body=GREEDY)
    assert [b.type for b in plain.content] == ["text"]
    # A budget shorter than the thinking: the runner ends it, and the answer follows.
    short: Any = {"type": "enabled", "budget_tokens": 2}
    cut = client.messages.create(
        model=MODEL, max_tokens=40, messages=messages, extra_body=GREEDY, thinking=short
    )
    assert [b.type for b in cut.content] == ["thinking", "text"], cut.content
    full, short_block = made.content[0], cut.content[0]
    assert full.type == "thinking" and short_block.type == "thinking"
    assert short_block.thinking and len(short_block.thinking) < len(full.thinking)
    assert full.thinking.startswith(short_block.thinking), (short_block.thinking, full.thinking)


def test_ollama_thinking(thinks: UpCluster) -> None:
    client = ollama.Client(host=thinks.base, headers={"Authorization": f"Bearer {thinks.key}"})
    history: list[Any] = []
    for question, thought, said in SHOTS:
        history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": said, "thinking": thought},
        ]
    messages = [*history, {"role": "user", "content": ASK}]
    options = {"temperature": 0, "num_predict": 40}
    made = client.chat(model=MODEL, messages=messages, think=True, options=options)
    assert made.message.thinking and made.message.content, made.message
    pieces = list(
        client.chat(model=MODEL, messages=messages, think=True, options=options, stream=True)
    )
    assert "".join(p.message.thinking or "" for p in pieces) == made.message.thinking
    off = client.chat(model=MODEL, messages=messages, think=False, options=options)
    assert not off.message.thinking and off.message.content


def test_responses_reasoning_items(thinks: UpCluster) -> None:
    client = openai.OpenAI(base_url=f"{thinks.base}/v1", api_key=thinks.key)
    items: list[Any] = []
    for question, thought, said in SHOTS:
        items += [
            {"role": "user", "content": question},
            {
                "type": "reasoning",
                "id": f"rs_{len(items)}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": thought}],
            },
            {"role": "assistant", "content": said},
        ]
    items.append({"role": "user", "content": ASK})
    made = client.responses.create(
        model=MODEL,
        input=items,
        temperature=0,
        max_output_tokens=40,
        reasoning={"effort": "low"},
        store=False,
    )
    assert [i.type for i in made.output] == ["reasoning", "message"], made.output
    assert made.usage is not None
    assert 0 < made.usage.output_tokens_details.reasoning_tokens < made.usage.output_tokens
    reasoning = made.output[0]
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text
    assert made.output_text
    with client.responses.stream(
        model=MODEL, input=items, temperature=0, max_output_tokens=40, store=False
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert final.output_text == made.output_text

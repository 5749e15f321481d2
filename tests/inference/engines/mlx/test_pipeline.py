"""An MLX model split by layers across processes over mlx's ring, against the same model in one
process. The stages' arithmetic is checked in-process; the ring with real processes, one per rank,
each on a test host of its own (the ring crosses their links, as between machines; the tests of
one process's failures stay on loopback), always killed at the end of their test."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
import pytest
from llama_cpp import llama_grammar
from mlx.utils import tree_flatten

from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams
from harness.hosts import Host, Network
from inference.decoding import Token
from inference.engines.mlx.engine import PREFILL_STEP, MlxEngine, load_model
from inference.engines.mlx.ring import PipelineShard
from inference.engines.mlx.stage import Stage
from tests.inference.engines.contract.running import free_text, hex_regex
from tests.inference.engines.pipeline_head import (
    decoding_of,
    grammar_of,
    prompt_of,
    run_task,
    serve_entry,
)

HEAD = "tests.inference.engines.pipeline_head"
FOLLOWER = "inference.engines.mlx.pipeline"
ROOT = Path(__file__).resolve().parents[4]


def shards(*bounds: int, hosts: tuple[str, ...] | None = None) -> list[PipelineShard]:
    """The ranks of a pipeline cutting the model's layers at ``bounds`` (first 0, last n)."""
    n = len(bounds) - 1
    hosts = hosts or tuple(f"127.0.0.1:{5000 + r}" for r in range(n))
    return [PipelineShard(r, n, bounds[r], bounds[r + 1], bounds[-1], hosts) for r in range(n)]


# --- the stages, in one process ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "bounds"), [("tiny_mlx", (0, 1, 3, 4)), ("tiny_mlx_tied", (0, 2, 4))]
)
def test_stages_compute_what_the_whole_model_does(
    model: str, bounds: tuple[int, ...], request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(model)
    whole = MlxEngine(path)
    whole.load()
    stages = [Stage.load(path, shard) for shard in shards(*bounds)]
    prompt = whole.chat_tokens([{"role": "user", "content": "Hello there"}], None)
    whole_cache = whole.model.make_cache()
    caches = [stage.new_cache() for stage in stages]
    step = prompt
    for _ in range(4):  # the prompt, then three tokens on the caches
        expected = whole.model(mx.array([step]), cache=whole_cache)[:, -1, :]
        x = mx.array([step])
        for stage, cache in zip(stages, caches, strict=True):
            x = stage.hidden(x, cache)
        got = stages[-1].logits(x)
        assert got.dtype == expected.dtype
        # Equal but for rounding: the stage's head multiplies the last position alone, the whole
        # model every position, and OpenBLAS chooses its kernel by the matrix's shape.
        assert mx.allclose(got, expected, rtol=1e-5, atol=1e-5).item()
        assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(expected, axis=-1)).item()
        step = [int(mx.argmax(got, axis=-1)[0])]


def test_a_stage_holds_only_its_part(tiny_mlx: Path, tiny_mlx_tied: Path) -> None:
    def names(path: Path, shard: PipelineShard) -> set[str]:
        stage = Stage.load(path, shard)
        parts = {"embed": stage.embed, "norm": stage.norm, "head": stage.head}
        return {name for name, part in parts.items() if part is not None} | {"layers"}

    first, middle, last = shards(0, 1, 3, 4)
    assert names(tiny_mlx, first) == {"layers", "embed"}
    assert names(tiny_mlx, middle) == {"layers"}
    assert names(tiny_mlx, last) == {"layers", "norm", "head"}
    assert len(Stage.load(tiny_mlx, middle).layers) == 2
    # The weights: a middle stage holds two of the four layers' and nothing else.
    model, _ = load_model(tiny_mlx)
    all_params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[no-untyped-call,assignment]
    layer_bytes = sum(v.nbytes for k, v in all_params if k.startswith("model.layers.1."))
    stage_params: list[tuple[str, mx.array]] = tree_flatten(
        Stage.load(tiny_mlx, middle).parameters()
    )  # type: ignore[assignment]
    assert sum(v.nbytes for _, v in stage_params) == 2 * layer_bytes
    # Tied: the last rank needs the embedding as its output layer.
    tied_last = Stage.load(tiny_mlx_tied, shards(0, 2, 4)[1])
    assert tied_last.head is not None and tied_last.embed is None
    assert "weight" in tied_last.head and tied_last.head["weight"].shape[0] > 256


def test_shards_must_make_sense() -> None:
    hosts = ("127.0.0.1:5000", "127.0.0.1:5001")
    with pytest.raises(ValueError, match="at least two"):
        PipelineShard(0, 1, 0, 4, 4, hosts[:1])
    with pytest.raises(ValueError, match="2 hosts for 3"):
        PipelineShard(0, 3, 0, 1, 4, hosts)
    with pytest.raises(ValueError, match="ip:port"):
        PipelineShard(0, 2, 0, 2, 4, ("127.0.0.1", "127.0.0.1:5001"))
    with pytest.raises(ValueError, match="layer 0"):
        PipelineShard(0, 2, 1, 2, 4, hosts)
    with pytest.raises(ValueError, match="last layer"):
        PipelineShard(1, 2, 2, 3, 4, hosts)
    with pytest.raises(ValueError, match="layers 3-2"):
        PipelineShard(1, 2, 3, 3, 4, hosts)


# --- real processes ---------------------------------------------------------------------------

RING_PORT = 5000  # each test host has its ports to itself


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes started for one test: killed at the end, whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            out, err = proc.communicate(timeout=10)
            sys.stdout.write(f"--- {proc.args!r} (exit {proc.returncode})\n{out}{err[-3000:]}\n")


def start(
    procs: list[subprocess.Popen[str]], module: str, *args: str, host: Host | None = None
) -> subprocess.Popen[str]:
    """``python -m module args``, on ``host`` when given (a test host), else on this machine."""
    argv = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(
        host.argv(argv) if host is not None else argv,
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    procs.append(proc)
    return proc


def run_pipeline(
    path: Path,
    bounds: tuple[int, ...],
    script: list[dict[str, Any]],
    net: Network,
    timeout: float = 90,
    n_ctx: int = 512,
    slots: int = 1,
) -> list[dict[str, Any]]:
    """Every rank as its own process on a test host of its own (rank ``r`` on host ``r``:
    the ring crosses their links, as between machines); the head serves ``script`` (see
    pipeline_head). Returns the head's results; every rank must have exited 0 after the
    shutdown."""
    on = net.hosts[: len(bounds) - 1]
    hosts = ",".join(f"{h.address}:{RING_PORT}" for h in on)
    common = [
        "--model",
        str(path),
        "--n-layers",
        str(bounds[-1]),
        "--hosts",
        hosts,
        "--connect-timeout",
        "60",
    ]
    with processes() as procs:
        # The head first: the last rank connects to it first, and mlx's retries back off.
        head = start(
            procs,
            HEAD,
            "--layers",
            f"0:{bounds[1]}",
            "--script",
            json.dumps(script),
            "--n-ctx",
            str(n_ctx),
            "--slots",
            str(slots),
            *common,
            host=on[0],
        )
        followers = []
        for r in range(1, len(bounds) - 1):
            layers = f"{bounds[r]}:{bounds[r + 1]}"
            follower = start(
                procs, FOLLOWER, "--rank", str(r), "--layers", layers, *common, host=on[r]
            )
            followers.append(follower)
        out, _ = head.communicate(timeout=timeout)
        assert head.returncode == 0
        for follower in followers:
            assert follower.wait(timeout=10) == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0] == {"ready": True} and lines[-1] == {"shutdown": True}
    return lines[1:-1]


def chat(n: int, text: str, logprobs: int | None = None, **params: object) -> TaskCreated:
    return TaskCreated(
        task_id=f"t{n}",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content=text)],
        params=SamplingParams.model_validate(params),
        logprobs=logprobs,
    )


SAMPLED: dict[str, Any] = {
    "temperature": 1.5,
    "top_p": 0.9,
    "seed": 11,
    "max_tokens": 30,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
}
SCRIPT: list[tuple[TaskCreated, int | str | None]] = [
    (chat(1, "What is the capital city of France?", temperature=0, max_tokens=40), None),
    # Left suspended after 3 tokens, holding one of the two slots while the others run.
    (chat(5, "Hello there", temperature=0), "abandon"),
    (chat(2, "Write a short poem about the sea.", temperature=0, max_tokens=40), None),
    # Cancelled after 5 tokens, then the same task in full: the ranks forgot the first one.
    (chat(3, "Count: one two three", temperature=0, max_tokens=40), 5),
    (chat(3, "Count: one two three", temperature=0, max_tokens=40), None),
    (chat(4, "Once upon a time", **SAMPLED), None),
]


def expected(path: Path) -> list[dict[str, Any]]:
    engine = MlxEngine(path, n_ctx=512)
    engine.load()
    out = []
    for task, cancel_after in SCRIPT:
        if isinstance(cancel_after, str):  # "abandon"
            tokens = engine.generate(prompt_of(engine, task), decoding_of(task))
            taken = islice((t.id for t in tokens if isinstance(t, Token)), 3)  # no PromptCached
            out.append({"tokens": list(taken), "abandoned": True})
        else:
            out.append(run_task(engine, task, cancel_after))
    return out


def script_entry(task: TaskCreated, cancel_after: int | str | None) -> dict[str, Any]:
    if cancel_after == "abandon":
        return {"task": task.model_dump(mode="json"), "abandon_after": 3}
    return {"task": task.model_dump(mode="json"), "cancel_after": cancel_after}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("model", "bounds"), [("tiny_mlx_tied", (0, 2, 4)), ("tiny_mlx", (0, 1, 3, 4))]
)
def test_a_split_model_answers_token_for_token_as_one_process(
    model: str, bounds: tuple[int, ...], request: pytest.FixtureRequest, hosts: Network
) -> None:
    path: Path = request.getfixturevalue(model)
    want = expected(path)
    script = [script_entry(*entry) for entry in SCRIPT]
    got = run_pipeline(path, bounds, script, hosts, slots=2)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert [g.get("finish") for g in got] == [w.get("finish") for w in want]
    assert [g.get("text") for g in got] == [w.get("text") for w in want]
    cancelled, full = got[3], got[4]
    assert cancelled["finish"] == "cancelled" and len(cancelled["tokens"]) == 5
    assert full["tokens"][:5] == cancelled["tokens"] and len(full["tokens"]) > 5
    assert all(len(g["tokens"]) > 1 for g in got)


def decoding_script(engine: MlxEngine) -> list[dict[str, Any]]:
    """Tasks with grammars, log-probabilities and prompt scores (see pipeline_head)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "n", "ok"],
    }
    json_grammar = {"gbnf": llama_grammar.json_schema_to_gbnf(json.dumps(schema))}
    # A lazy grammar that starts inside a token of the free greedy output (test_mlx_sampling).
    _, greedy, j = free_text(engine)
    before = b"".join(engine.piece(t.id) for t in greedy[:j])
    piece = engine.piece(greedy[j].id)
    lazy = {
        "gbnf": f'root ::= "{piece[1:].decode()}" [0-9] [0-9] "."',
        "triggers": [hex_regex(before + piece[:1]) + "(" + hex_regex(piece[1:2]) + ")"],
    }
    unfit = {"gbnf": 'root ::= "zzz"', "triggers": [hex_regex(piece)]}
    story = completion(5, "Once upon a time", temperature=0, max_tokens=30, logprobs=1)
    resumed = {
        "task": js(chat(9, "Hi", temperature=0, max_tokens=60, frequency_penalty=0.5)),
        "grammar": json_grammar,
    }
    resumed_task = TaskCreated.model_validate(resumed["task"])
    # Two prefill chunks, each scored on the last rank.
    long_text = " ".join(["the sea is blue, hello world."] * 60)
    assert PREFILL_STEP + 1 < len(engine.text_tokens(long_text)) < 1000
    return [
        {
            "task": js(chat(1, "Hi", temperature=0, max_tokens=60, logprobs=2)),
            "grammar": json_grammar,
        },
        {
            "task": js(chat(2, "Hi", temperature=1.0, seed=5, max_tokens=60, logprobs=0)),
            "grammar": json_grammar,
        },
        {"task": completion(3, long_text, temperature=0, max_tokens=4, logprobs=3, echo=True)},
        {"task": completion(4, "hello world", temperature=0, max_tokens=0, echo=True)},
        {"task": story, "grammar": lazy},
        # The trigger's text does not fit this grammar: the last rank fails the task...
        {"task": story, "grammar": unfit},
        # ...and serves the next one.
        {
            "task": js(
                chat(
                    7,
                    "Hello there",
                    temperature=1.2,
                    seed=3,
                    max_tokens=20,
                    top_k=20,
                    min_p=0.05,
                    repeat_penalty=1.3,
                    logit_bias={5: 3.0},
                )
            )
        },
        # Resumed after the first 6 tokens of its JSON (its runner was lost): the grammar and
        # the penalties go on after them.
        resumed
        | {"generated": run_task(engine, resumed_task, grammar=grammar_of(resumed))["tokens"][:6]},
    ]


def js(task: TaskCreated) -> dict[str, Any]:
    return task.model_dump(mode="json")


def completion(n: int, text: str, **fields: object) -> dict[str, Any]:
    """A completion task's JSON; ``fields``: sampling parameters, and ``logprobs``, ``echo``."""
    extra = {k: fields.pop(k) for k in ("logprobs", "echo") if k in fields}
    task = TaskCreated(
        task_id=f"t{n}",
        model_id="m",
        origin="test",
        kind="completion",
        prompt=text,
        params=SamplingParams.model_validate(fields),
    )
    return task.model_dump(mode="json") | extra


def but_rounding(value: Any) -> Any:
    """``value`` with each float made a ``pytest.approx`` of it, to compare results that may
    differ in their floats' last digits."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-5, abs=1e-5)
    if isinstance(value, dict):
        return {k: but_rounding(v) for k, v in value.items()}
    if isinstance(value, list):
        return [but_rounding(v) for v in value]
    return value


def serve_script(engine: MlxEngine, script: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The script through one process, as pipeline_head serves it."""
    return [serve_entry(engine, entry) for entry in script]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("model", "bounds"), [("tiny_mlx", (0, 2, 4)), ("tiny_mlx_tied", (0, 1, 3, 4))]
)
def test_a_split_model_constrains_and_scores_as_one_process(
    model: str, bounds: tuple[int, ...], request: pytest.FixtureRequest, hosts: Network
) -> None:
    path: Path = request.getfixturevalue(model)
    engine = MlxEngine(path, n_ctx=1024)
    engine.load()
    script = decoding_script(engine)
    want = serve_script(engine, script)
    got = run_pipeline(path, bounds, script, hosts, n_ctx=1024)
    for g, w in zip(got, want, strict=True):
        g.pop("seconds", None), w.pop("seconds", None)
    # (A split model sums its floats in another order: mlx 0.32.4 differed by 4e-6.)
    assert got == but_rounding(want)
    # What the script meant to show is there.
    first, _, echoed, scored_only, lazy, failed, after, resumed = want
    whole = serve_entry(engine, {k: v for k, v in script[-1].items() if k != "generated"})
    assert resumed["tokens"] == whole["tokens"][6:] and resumed["finish"] == "stop"
    assert json.loads(first["text"], strict=False).keys() == {"name", "n", "ok"}
    assert len(first["logprobs"]) == len(first["tokens"]) and first["finish"] == "stop"
    assert len(echoed["prompt"]) > PREFILL_STEP and echoed["prompt"][0]["logprob"] is None
    assert len(echoed["prompt"][-1]["top"]) == 3 and len(echoed["tokens"]) == 4
    assert len(scored_only["prompt"]) > 1 and scored_only["tokens"] == []
    assert lazy["finish"] == "stop" and lazy["text"][-3:-1].isdigit() and lazy["logprobs"]
    assert "does not fit" in failed["invalid"] and len(after["tokens"]) == 20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_split_model_decodes_tasks_together_as_each_alone(tiny_mlx: Path, hosts: Network) -> None:
    """Every task of the decoding script in flight at once, on three ranks: each gets what it
    gets alone in one process, decoding steps serve several at once, and the ring serves the
    next task after them."""
    engine = MlxEngine(tiny_mlx, n_ctx=1024)
    engine.load()
    script = decoding_script(engine)
    script[0] = script[0] | {"cancel_after": 7}
    want = serve_script(engine, script)
    after = {
        "task": js(chat(8, "What is the capital city of France?", temperature=0, max_tokens=12))
    }
    want_after = serve_script(engine, [after])
    got = run_pipeline(
        tiny_mlx,
        (0, 1, 3, 4),
        [{"together": script}, after],
        hosts,
        n_ctx=1024,
        slots=len(script),
    )
    together, alone = got
    for g, w in zip([*together["together"], alone], [*want, *want_after], strict=True):
        g.pop("seconds", None), w.pop("seconds", None)
        # The same tokens; logprobs equal but for rounding: tasks decoded together are rows of
        # one product, which OpenBLAS computes with other kernels than one row alone.
        assert g == but_rounding(w)
    assert want[0]["finish"] == "cancelled" and "does not fit" in want[5]["invalid"]
    # A sequence is stepped with the others even when its consumer is not asking yet (up to
    # its own limit): how wide a step is depends on the threads' timing, not how many steps
    # the longest task takes (46 tokens) against all of them (86).
    assert together["widest"] >= 3
    assert together["passes"] < 0.8 * sum(len(w.get("tokens", [])) for w in want)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_model_split_in_two_answers_as_one_process(
    smollm2_mlx: Path, hosts: Network
) -> None:
    """SmolLM2-135M converted from its GGUF: mlx's CPU backend is slow on Linux (reference
    BLAS), so short answers."""
    tasks = [
        chat(
            1,
            "What is the capital city of France? Answer in one word.",
            temperature=0,
            max_tokens=10,
        ),
        TaskCreated(
            task_id="t2",
            model_id="m",
            origin="test",
            kind="completion",
            prompt="The three primary colors are",
            params=SamplingParams(temperature=0, max_tokens=8),
        ),
    ]
    engine = MlxEngine(smollm2_mlx, n_ctx=512)
    engine.load()
    want = [run_task(engine, task) for task in tasks]
    assert "Paris" in want[0]["text"]
    script = [script_entry(task, None) for task in tasks]
    got = run_pipeline(smollm2_mlx, (0, 15, 30), script, hosts, timeout=180)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]


def two_ranks(path: Path) -> tuple[list[str], list[str]]:
    """The arguments of a 2-rank pipeline's head and follower."""
    hosts = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    common = ["--model", str(path), "--n-layers", "4", "--hosts", hosts]
    return ["--layers", "0:2", *common], ["--rank", "1", "--layers", "2:4", *common]


def read_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else ""
    out: dict[str, Any] = json.loads(line)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_follower_waits_idle_and_exits_non_zero_when_the_head_dies(tiny_mlx: Path) -> None:
    head_args, follower_args = two_ranks(tiny_mlx)
    script = json.dumps([script_entry(chat(1, "Hi", temperature=0, max_tokens=4), None)])
    with processes() as procs:
        follower = start(procs, FOLLOWER, *follower_args)
        # A head that never shuts the pipeline down.
        head = start(procs, HEAD, "--script", script, "--hold", *head_args)
        assert read_line(head) == {"ready": True}
        assert len(read_line(head)["tokens"]) == 4
        assert read_line(head) == {"holding": True}
        # Waiting for the next request costs no CPU (mlx alone would spin on its socket).
        waiting = psutil.Process(follower.pid)
        before = waiting.cpu_times()
        time.sleep(1.0)
        after = waiting.cpu_times()
        assert (after.user + after.system) - (before.user + before.system) < 0.2
        head.send_signal(signal.SIGKILL)
        assert follower.wait(timeout=30) == 1
        assert follower.stderr is not None
        assert "connection to a peer was lost" in follower.stderr.read()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_head_fails_its_next_task_when_a_rank_dies(tiny_mlx: Path) -> None:
    head_args, follower_args = two_ranks(tiny_mlx)
    task = script_entry(chat(1, "Hi", temperature=0, max_tokens=4), None)
    script = json.dumps([task, {"wait": True}, task])
    with processes() as procs:
        follower = start(procs, FOLLOWER, *follower_args)
        head = start(procs, HEAD, "--script", script, *head_args)
        assert read_line(head) == {"ready": True}
        assert len(read_line(head)["tokens"]) == 4
        follower.kill()
        follower.wait(timeout=10)
        assert head.stdin is not None
        head.stdin.write("go on\n")
        head.stdin.flush()
        assert "connection to a peer was lost" in read_line(head)["broken"]
        assert head.wait(timeout=30) == 3


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_ring_listens_on_the_given_address_and_gives_up_in_time(tiny_mlx: Path) -> None:
    ports = free_ports(2)
    hosts = f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    with processes() as procs:
        # Rank 0 alone: it waits for rank 1's connection, listening on its address only.
        head = start(
            procs,
            HEAD,
            "--model",
            str(tiny_mlx),
            "--n-layers",
            "4",
            "--hosts",
            hosts,
            "--layers",
            "0:2",
            "--script",
            "[]",
            "--connect-timeout",
            "2",
        )
        listening: list[tuple[str, int]] = []
        while not listening and head.poll() is None:
            listening = [
                (c.laddr.ip, c.laddr.port)
                for c in psutil.Process(head.pid).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN
            ]
            time.sleep(0.05)
        # From when it listens (its imports before that take seconds on a loaded machine).
        began = time.monotonic()
        assert listening == [("127.0.0.1", ports[0])]
        assert head.wait(timeout=30) == 1
        assert time.monotonic() - began < 10

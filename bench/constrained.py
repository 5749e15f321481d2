"""Constrained decoding: a JSON-schema reply and a required tool call against free generation of
the same length, on both engines, side by side.

    .venv/bin/python -m bench.constrained [--engines llamacpp,mlx] [--rounds 7]
                                           [--tokens 96] [--mlx-tokens 48] [--case NAME ...]

Everything runs in this process, through the runner's own path for a task: ``prepare`` (the
reply plan, its grammar, the prompt through the chat template) and ``steps`` (the engine's
tokens, the reply parser), what a runner does between receiving a task and publishing its
chunks. Engines: SmolLM2-135M-Instruct, Q4_1 GGUF on llama.cpp (2 threads), and the same
weights converted to an MLX model (float32) on mlx-lm. Greedy decoding.

Per round, in turn, on each engine:

- ``schema``: a chat asking for a city, with a ``json_schema`` response format of 10 properties
  (the grammar already built, as for every request after a schema's first);
- ``tool``: the same chat with two function tools and ``tool_choice: required``;
- ``free``: the same prompt (for ``tool``, the tools described in it) without the grammar and
  the reply parser, as many tokens as the constrained run produced (its end tokens banned
  with ``logit_bias``, so that it runs that long);
- ``schema (new)``: the schema with property names never seen before, so that both grammar
  caches miss: what the first request with a schema pays;
- ``thinking tool``: a thinking model (SmolLM2 with Qwen3's kind of chat template, from
  ``harness/models/templated.py``; earlier turns show it how to think) thinks in ``<think>``, then
  makes the required call: the grammar holds from the first token, the thinking free up to
  ``</think>`` (``structured/reasoning_grammar.py``), and the reply parser reads the thinking
  apart (at least 96 tokens a run: the thinking and the call take about 70). A run that did
  not think, or did not end with the call, fails the benchmark. On llama.cpp only: on MLX the
  same model in float32 makes the call at once, without thinking.

``--case`` runs only the cases named (repeated, or comma-separated).

Tokens/s is the decode rate after the first token; the ratio is the median over the rounds
of each constrained run's tokens/s over its free run's, which comes right after it. Time to
first token is from ``prepare`` to the first token (it depends on what the last run left in
llama.cpp's KV cache: ``tool``'s prompt, with the tools described, is longer, and the run
after it finds less of its own); "setup" is its part before the prompt runs: ``prepare`` (the
plan, the grammar's GBNF) and the engine's ``generate()`` call, where both engines compile
the grammar, what a new schema adds to the first token. Targets:
constrained tokens/s at least 0.9x free; a new 10-property schema adds at most 20 ms of setup
(``schema (new)`` against ``free``). The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.report import verdict
from events.catalogue import TaskCreated
from events.records import ChatMessage, ResponseFormat, SamplingParams, Tool, ToolChoice
from harness.models.templated import QWEN3, SMOLLM2, gguf_with_template, mlx_with_template
from inference.decoding import Decoding, PromptCached, PromptScores, Token
from inference.engines.base import Engine
from inference.generation import Step, check_request, steps
from inference.job import Job, prepare
from structured.reply import PlainReply

TPS_TARGET = 0.9
# The thinking case's least max_tokens: its thinking and call take about 70.
THINKING_TOKENS = 96
TTFT_TARGET_MS = 20.0

ASK = [ChatMessage(role="user", content="Describe the city of Lisbon in detail.")]
# Earlier turns that show the model how it thinks (at some length: with the tests' one-line
# thoughts it thinks 15 tokens of 80), then a question for a tool.
ASK_THINKING = [
    ChatMessage(role="user", content="What is 12 + 7?"),
    ChatMessage(
        role="assistant",
        content="19.",
        reasoning="The user asks for a sum. Twelve and seven: ten and seven make seventeen, and"
        " two more make nineteen. So the answer is nineteen.",
    ),
    ChatMessage(role="user", content="What is 3 + 3?"),
    ChatMessage(
        role="assistant",
        content="6.",
        reasoning="The user asks for another sum. Three and three make six; I can check it by"
        " counting: four, five, six. So the answer is six.",
    ),
    ChatMessage(role="user", content="What is the weather in Lisbon?"),
]
TOOLS = [
    Tool(
        name="get_weather",
        description="The current weather in a city.",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    ),
    Tool(
        name="find_places",
        description="Places of a kind in a city.",
        parameters={
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "kind": {"enum": ["museum", "park", "restaurant"]},
                "limit": {"type": "integer"},
            },
            "required": ["city", "kind"],
        },
    ),
]


def city_schema(suffix: str = "") -> dict[str, Any]:
    """Ten properties of the usual kinds; ``suffix`` renames them (a schema never seen)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["hot", "mild", "cold"]},
        {"type": "array", "items": {"type": "string"}},
        {"type": "string"},
        {"type": "integer"},
        {"type": "array", "items": {"type": "integer"}},
    ]
    names = [
        "name",
        "country",
        "population",
        "area_km2",
        "coastal",
        "climate",
        "landmarks",
        "mayor",
        "founded",
        "postcodes",
    ]
    props = {f"{n}{suffix}": k for n, k in zip(names, kinds, strict=True)}
    return {"type": "object", "properties": props, "required": list(props)}


@dataclass(frozen=True)
class Run:
    tokens: int
    setup_ms: float  # prepare and the engine's generate() call: plan, grammar, its compilation
    ttft_ms: float
    tps: float
    finish: str | None = None  # the reply's finish reason (a constrained run's)
    reasoning_tokens: int = 0  # of ``tokens``, the thinking's (a constrained run's)


class _Started:
    """An engine whose generation was started already (to time its start apart)."""

    def __init__(
        self, engine: Engine, items: Iterator[Token | PromptScores | PromptCached]
    ) -> None:
        self._engine = engine
        self._items = items

    def generate(
        self, prompt: list[int], decoding: Decoding
    ) -> Iterator[Token | PromptScores | PromptCached]:
        return self._items

    def piece(self, token: int) -> bytes:
        return self._engine.piece(token)

    def spelled(self, token: int) -> bytes:
        return self._engine.spelled(token)

    def is_end(self, token: int) -> bool:
        return self._engine.is_end(token)


def run(engine: Engine, task: TaskCreated, free_for: int | None = None) -> Run:
    """The runner's path for ``task``; the engine's ``generate()`` call compiles the grammar
    (both engines do it there) and computes nothing else: the prompt runs at the first token.

    ``free_for``: the same prompt without the grammar and the parser, for that many tokens
    (its end tokens banned, so that it runs that long); its setup is what a request without
    tools or response format prepares."""
    prompt = prepare(engine, task).prompt if free_for is not None else []
    started = time.perf_counter()
    if free_for is None:
        job = prepare(engine, task)
    else:
        bare = task.model_copy(
            update={"tools": [], "response_format": None, "tool_choice": ToolChoice(mode="none")}
        )
        prepare(engine, bare)
        params = SamplingParams(
            temperature=0.0, max_tokens=free_for, logit_bias=dict.fromkeys(_ends(engine), -100.0)
        )
        job = Job(prompt, Decoding(params), PlainReply())
    limit = check_request(len(job.prompt), job.decoding.params, engine.n_ctx)
    items = engine.generate(job.prompt, job.decoding)
    ready = time.perf_counter()
    source = _Started(engine, items)
    times: list[float] = []
    last: Step | None = None
    for s in steps(source, job.prompt, job.decoding, limit, lambda: False, job.reply):
        if isinstance(s, Step):
            if s.token_id is not None:
                times.append(time.perf_counter())
            last = s
    if len(times) < 2:
        raise RuntimeError(f"{task.task_id}: {len(times)} tokens")
    return Run(
        len(times),
        (ready - started) * 1000,
        (times[0] - started) * 1000,
        (len(times) - 1) / (times[-1] - times[0]),
        last.finish_reason if last is not None else None,
        last.reasoning_tokens if last is not None else 0,
    )


_END_TOKENS: dict[int, tuple[int, ...]] = {}


def _ends(engine: Engine) -> tuple[int, ...]:
    """The engine's end tokens (at most 64), found once."""
    if id(engine) not in _END_TOKENS:
        _END_TOKENS[id(engine)] = tuple(t for t in range(engine.n_vocab) if engine.is_end(t))[:64]
    return _END_TOKENS[id(engine)]


def task(name: str, max_tokens: int, **fields: Any) -> TaskCreated:
    params = fields.pop("params", SamplingParams(temperature=0.0, max_tokens=max_tokens))
    messages = fields.pop("messages", ASK)
    return TaskCreated(
        task_id=name, model_id="m", origin="bench", messages=messages, params=params, **fields
    )


@dataclass
class Pair:
    """Each constrained run, and the free run of the same length right after it."""

    constrained: list[Run]
    free: list[Run]

    def tps_ratio(self) -> float:
        return statistics.median(
            c.tps / f.tps for c, f in zip(self.constrained, self.free, strict=True)
        )

    def setup_added(self) -> float:
        return statistics.median(
            c.setup_ms - f.setup_ms for c, f in zip(self.constrained, self.free, strict=True)
        )


# The cases, and the chat template of the model each runs on (None: SmolLM2's own).
CASES: dict[str, str | None] = {
    "schema": None,
    "tool": None,
    "schema (new)": None,
    "thinking tool": QWEN3,
}

# On llama.cpp only: on MLX (SmolLM2 in float32, llguidance's grammar) the reply is the call
# without a thinking (0 thinking tokens of 35), whether from the model's weights or from the
# grammar's optional "<think>" not yet known.
LLAMACPP_ONLY = {"thinking tool"}


def cases(tokens: int) -> dict[str, Callable[[int], TaskCreated]]:
    """Each case's task for a round (-1: the warm-up)."""
    schema = ResponseFormat(type="json_schema", json_schema=city_schema())
    required = ToolChoice(mode="required")
    return {
        "schema": lambda _: task("schema", tokens, response_format=schema),
        "tool": lambda _: task(
            "tool", tokens, tools=TOOLS, parallel_tool_calls=False, tool_choice=required
        ),
        # A schema never seen: named after the time and the round.
        "schema (new)": lambda r: task(
            "new",
            tokens,
            response_format=ResponseFormat(
                type="json_schema", json_schema=city_schema(f"_{time.time_ns()}_{r}")
            ),
        ),
        "thinking tool": lambda _: task(
            "thinking",
            max(tokens, THINKING_TOKENS),
            messages=ASK_THINKING,
            tools=TOOLS,
            parallel_tool_calls=False,
            tool_choice=required,
        ),
    }


def measure(engine: Engine, rounds: int, tokens: int, names: list[str]) -> dict[str, Pair]:
    made = cases(tokens)
    chosen = {name: made[name] for name in names}
    for name, make in chosen.items():  # warm: the engine's first steps, the cached grammars
        _check(name, run(engine, make(-1)))
    pairs = {name: Pair([], []) for name in chosen}
    for r in range(rounds):
        for name, make in chosen.items():
            asked = make(r)
            constrained = _check(name, run(engine, asked))
            pairs[name].constrained.append(constrained)
            pairs[name].free.append(run(engine, asked, free_for=constrained.tokens))
    return pairs


def _check(name: str, done: Run) -> Run:
    """``done``, if it is what its case measures: a thinking case's reply thought, then called."""
    if name == "thinking tool" and not (done.reasoning_tokens and done.finish == "tool_calls"):
        raise RuntimeError(
            f"{name}: {done.reasoning_tokens} tokens of thinking of {done.tokens},"
            f" finish {done.finish} (a thinking, then a call, expected)"
        )
    return done


def load(name: str, tmp: Path, template: str | None = None) -> Engine:
    """The engine ``name`` on SmolLM2, with ``template`` as its chat template if given."""
    if name == "llamacpp":
        from inference.engines.llamacpp.engine import LlamaCppEngine

        path = SMOLLM2 if template is None else gguf_with_template(template, tmp)
        llama = LlamaCppEngine(path, n_ctx=2048, n_threads=2)
        llama.load()
        return llama
    from inference.engines.mlx.engine import MlxEngine
    from services.models.gguf_to_mlx import gguf_to_mlx

    converted = tmp / "smollm2-mlx"
    if not converted.exists():
        gguf_to_mlx(SMOLLM2, converted)
    if template is not None:
        converted = mlx_with_template(converted, Path(tempfile.mkdtemp(dir=tmp)) / "m", template)
    mlx = MlxEngine(converted, n_ctx=2048)
    mlx.load()
    return mlx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--engines", default="llamacpp,mlx")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=96, help="most tokens a run, llama.cpp")
    parser.add_argument("--mlx-tokens", type=int, default=48, help="most tokens a run, MLX")
    parser.add_argument(
        "--case",
        action="append",
        help=f"run only this case (repeated, or comma-separated): {', '.join(CASES)}",
    )
    args = parser.parse_args(argv)
    names = [n for given in args.case for n in given.split(",")] if args.case else list(CASES)
    if unknown := [n for n in names if n not in CASES]:
        parser.error(f"no case {', '.join(unknown)} (the cases: {', '.join(CASES)})")
    # One engine a chat template, each with its cases, in their order.
    by_template: dict[str | None, list[str]] = {}
    for case in CASES:
        if case in names:
            by_template.setdefault(CASES[case], []).append(case)
    ok = True
    print(
        f"{'engine':9} {'case':13} {'tokens':>6} {'tok/s':>7} {'free':>7} {'ratio':>6}"
        f" {'TTFT ms':>8} {'free':>7} {'setup ms':>9} {'free':>6} {'added':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.engines.split(","):
            tokens = args.tokens if name == "llamacpp" else args.mlx_tokens
            for template, all_chosen in by_template.items():
                chosen = [c for c in all_chosen if name == "llamacpp" or c not in LLAMACPP_ONLY]
                if skipped := [c for c in all_chosen if c not in chosen]:
                    print(f"{name:9} {', '.join(skipped)}: not on this engine (see the docstring)")
                if not chosen:
                    continue
                engine = load(name, Path(tmp), template)
                for case, pair in measure(engine, args.rounds, tokens, chosen).items():
                    ok = report(name, case, pair) and ok
                del engine
    print("targets met" if ok else "a target was missed")
    return 0 if ok else 1


def report(engine: str, case: str, pair: Pair) -> bool:
    """Print a case's line; whether it met its target."""
    c, f = pair.constrained, pair.free
    ratio, added = pair.tps_ratio(), pair.setup_added()
    med = statistics.median
    print(
        f"{engine:9} {case:13} {med(r.tokens for r in c):>6.0f}"
        f" {med(r.tps for r in c):>7.1f} {med(r.tps for r in f):>7.1f}"
        f" {ratio:>5.2f}x {med(r.ttft_ms for r in c):>8.1f}"
        f" {med(r.ttft_ms for r in f):>7.1f} {med(r.setup_ms for r in c):>9.2f}"
        f" {med(r.setup_ms for r in f):>6.2f} {added:>+6.2f}"
    )
    if any(r.reasoning_tokens for r in c):
        print(f"  of which thinking: {med(r.reasoning_tokens for r in c):.0f} tokens")
    if case != "schema (new)" and ratio < TPS_TARGET:
        print(f"  {verdict(False)}: {case} at {ratio:.2f}x the free tokens/s ({TPS_TARGET}x)")
        return False
    if case == "schema (new)" and added > TTFT_TARGET_MS:
        print(f"  {verdict(False)}: a new schema adds {added:.1f} ms ({TTFT_TARGET_MS} ms)")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())

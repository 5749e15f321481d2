"""The MLX engine's prompt cache, in process: a 1,500-token conversation's second turn against
its first, and against the same second turn run whole (the cache emptied), side by side.

    .venv/bin/python -m bench.mlx_prompt_cache [--slots 4] [--rounds 1]

SmolLM2-135M-Instruct (its GGUF, dequantized to an MLX model dir), greedy. TTFT: from the
``generate`` call to the first token. Each round runs the three in turn; medians are printed.
mlx[cpu] on Linux prefills slowly with the wheel's reference BLAS (minutes a round), less so
with OpenBLAS (``bench/mlx_blas.py``).
Target (issue 19): the second turn's first token >= 5x sooner than the first turn's; a miss
is a MISSED line and exit 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common.chat import LONG_TURN
from bench.common.report import verdict
from events.records import SamplingParams
from harness.models.templated import SMOLLM2
from inference.decoding import Decoding, PromptCached, Token
from inference.engines.mlx.engine import MlxEngine
from services.models.gguf_to_mlx import gguf_to_mlx

ANSWER_TOKENS = 16


def ttft(engine: MlxEngine, prompt: list[int], tokens: int) -> tuple[float, int, list[int]]:
    """Seconds to the first token, the prompt's tokens that were cached, and the answer."""
    started = time.perf_counter()
    first, cached, answer = 0.0, 0, []
    generation = engine.generate(prompt, Decoding(SamplingParams(temperature=0)))
    for item in generation:
        if isinstance(item, PromptCached):
            cached = item.tokens
        elif isinstance(item, Token):
            first = first or time.perf_counter() - started
            if engine.is_end(item.id):
                break
            answer.append(item.id)
            if len(answer) >= tokens:
                break
    generation.close()  # type: ignore[attr-defined]
    return first, cached, answer


def emptied(engine: MlxEngine) -> None:
    """The engine's prompt cache emptied, once a closed generation's cache was kept."""
    decoder = engine._decoder
    while decoder is not None and decoder.busy:
        time.sleep(0.01)
    kept = engine._kept if decoder is None else decoder._kept
    assert kept is not None
    kept.clear()


def measure(engine: MlxEngine, rounds: int) -> dict[str, list[float]]:
    first_chat = [{"role": "user", "content": f"{LONG_TURN}\nWhat did the diary say?"}]
    first_prompt = engine.chat_tokens(first_chat, None)
    times: dict[str, list[float]] = {"first turn": [], "second turn": [], "second, whole": []}
    ttft(engine, engine.text_tokens("Warm up."), 2)
    for _ in range(rounds):
        emptied(engine)
        t1, _, answer = ttft(engine, first_prompt, ANSWER_TOKENS)
        reply = b"".join(engine.piece(t) for t in answer).decode(errors="replace")
        second_chat = [
            *first_chat,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And on the last day?"},
        ]
        second_prompt = engine.chat_tokens(second_chat, None)
        t2, cached, _ = ttft(engine, second_prompt, 1)
        emptied(engine)
        t3, none, _ = ttft(engine, second_prompt, 1)
        assert cached >= len(first_prompt) and none == 0, (cached, none)
        times["first turn"].append(t1)
        times["second turn"].append(t2)
        times["second, whole"].append(t3)
    print(
        f"  prompts: first {len(first_prompt)} tokens, second {len(second_prompt)},"
        f" {cached} of them cached"
    )
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[4])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    ok = True
    print("# MLX prompt cache: SmolLM2-135M (float32), TTFT medians in process")
    with tempfile.TemporaryDirectory(prefix="shoal-mlx-cache-") as d:
        model_dir = gguf_to_mlx(SMOLLM2, Path(d) / "smollm2-mlx")
        for slots in args.slots:
            engine = MlxEngine(model_dir, n_ctx=4096, slots=slots)
            engine.load()
            try:
                print(f"slots {slots}:")
                med = {k: statistics.median(v) for k, v in measure(engine, args.rounds).items()}
            finally:
                engine.close()
            for name, s in med.items():
                print(f"  {name:14} {s * 1000:8.1f} ms")
            sooner = med["first turn"] / med["second turn"]
            whole = med["second, whole"] / med["second turn"]
            passed = sooner >= 5
            ok &= passed
            print(
                f"{verdict(passed)} slots {slots}: second turn {sooner:.1f}x"
                f" sooner than the first (target >= 5x), {whole:.1f}x sooner than run"
                " whole"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

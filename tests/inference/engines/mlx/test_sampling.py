"""How the MLX engine picks tokens (``mlx_sampling``), beyond what every engine does
(``contract/``): grammars (llama.cpp's GBNF through llguidance: compiled once, special tokens,
long repetitions, a trigger whose text does not fit), log-probabilities on a tied bfloat16
model, and the sampling parameters, on the tiny random-weight model; grammars and speed on
SmolLM2 too."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from llama_cpp import llama_grammar

from inference.decoding import LOGPROB_FLOOR
from inference.engines.mlx.engine import MlxEngine
from inference.engines.mlx.sampling import Picker, as_tokens, prompt_scores
from structured.reply import Grammar, InvalidRequest
from tests.inference.engines.contract.running import (
    SMALL_SCHEMA,
    decoding,
    free_text,
    hex_regex,
    schema_grammar,
    text,
    tokens,
    valid,
)


@pytest.fixture(scope="module")
def engine(tiny_mlx: Path) -> MlxEngine:
    engine = MlxEngine(tiny_mlx, n_ctx=1024)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def tied(tiny_mlx_tied: Path) -> MlxEngine:
    engine = MlxEngine(tiny_mlx_tied, n_ctx=512)
    engine.load()
    return engine


# --- grammars ---------------------------------------------------------------------------------


def test_a_json_schema_grammar_holds_at_temperature_one_on_a_tied_bfloat16_model(
    tied: MlxEngine,
) -> None:
    """The contract's test (``contract/test_grammar.py``) on the tiny model with its output
    layer tied to the embedding, in bfloat16."""
    engine = tied
    prompt = engine.text_tokens("Once upon a time")
    grammar = schema_grammar(SMALL_SCHEMA)
    outputs = set()
    for seed in range(6):
        out = tokens(engine, prompt, 300, decoding(grammar, temperature=1.0, seed=seed))
        # It ends, with an end token, as soon as the grammar is complete.
        assert engine.is_end(out[-1].id)
        # strict=False: llama-cpp-python's converter lets control characters into strings
        # (its "char" is [^"\\]), which a random model writes.
        assert valid(json.loads(text(engine, out), strict=False))
        outputs.add(text(engine, out))
    assert len(outputs) > 3  # the seeds still choose


def test_a_grammar_is_compiled_once_and_copied(engine: MlxEngine) -> None:
    grammars = engine.text.grammars
    grammar = schema_grammar(SMALL_SCHEMA)
    prompt = engine.text_tokens("Once upon a time")
    first = tokens(engine, prompt, 300, decoding(grammar, temperature=0))
    assert grammar.gbnf in grammars._compiled
    compiled = grammars._compiled[grammar.gbnf]
    # The second task starts from the grammar's start, not where the first one left it.
    assert tokens(engine, prompt, 300, decoding(grammar, temperature=0)) == first
    assert grammars._compiled[grammar.gbnf] is compiled


def test_a_trigger_whose_text_does_not_fit_the_grammar_fails_the_task(
    engine: MlxEngine,
) -> None:
    prompt, greedy, j = free_text(engine)
    trigger = hex_regex(engine.piece(greedy[j].id))
    generated = engine.generate(
        prompt, decoding(Grammar('root ::= "zzz"', (trigger,)), temperature=0)
    )
    with pytest.raises(InvalidRequest, match="does not fit"):
        list(islice(generated, 20))


def test_special_tokens_satisfy_their_literal_as_in_llama_cpp(engine: MlxEngine) -> None:
    """llama.cpp's grammar sees a special token's text: ``"<|im_start|>"`` in a grammar is
    that token (the end tokens excepted: they end generation)."""
    im_start = engine.text._tokenizer.convert_tokens_to_ids("<|im_start|>")
    out = tokens(
        engine,
        engine.text_tokens("hi"),
        10,
        decoding(Grammar('root ::= "<|im_start|>" "ok"'), temperature=0),
    )
    assert out[0].id == im_start and engine.is_end(out[-1].id)
    assert text(engine, out[1:]) == b"ok"


# --- log-probabilities ------------------------------------------------------------------------


def direct_logprobs(engine: MlxEngine, sequence: list[int]) -> np.ndarray[Any, Any]:
    """log_softmax of the model's logits over ``sequence`` in one pass: row i is the
    distribution of the token after position i."""
    logits = engine.model(mx.array([sequence]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_logprobs_are_the_raw_logits_log_softmax_on_a_tied_bfloat16_model(
    tied: MlxEngine,
) -> None:
    """The contract's test (``contract/test_logprobs.py``) on the tiny model with its output
    layer tied to the embedding, in bfloat16: within a quarter (incremental and whole runs
    round differently in bfloat16), most likely first."""
    engine = tied
    prompt = engine.text_tokens("Once upon a time")
    # Penalties, bias, grammar and temperature change the choice, not the reported numbers.
    params: dict[str, Any] = {
        "temperature": 1.5,
        "seed": 4,
        "presence_penalty": 1.0,
        "repeat_penalty": 1.3,
        "logit_bias": {10: 5.0},
        "top_k": 50,
    }
    out = tokens(engine, prompt, 12, decoding(None, 5, **params))
    assert [t.id for t in out] == [t.id for t in tokens(engine, prompt, 12, decoding(**params))]
    want = direct_logprobs(engine, prompt + [t.id for t in out])
    tolerance = 0.25  # bfloat16 logits: incremental vs batch
    for i, token in enumerate(out):
        row = want[len(prompt) - 1 + i]
        assert token.logprob == pytest.approx(float(row[token.id]), abs=tolerance)
        assert len(token.top) == 5
        assert [lp for _, lp in token.top] == sorted((lp for _, lp in token.top), reverse=True)
        assert all(lp >= LOGPROB_FLOOR for _, lp in token.top)


def test_logprobs_are_floored() -> None:
    logits = mx.array([[0.0, -mx.inf, -20000.0, 1.0]])
    ids, lps = prompt_scores(logits, [1], 4)
    token = as_tokens(ids, lps)[0]
    assert token.id == 1 and token.logprob == LOGPROB_FLOOR
    assert [t for t, _ in token.top] == [3, 0, 2, 1]
    assert token.top[2][1] == LOGPROB_FLOOR and token.top[3][1] == LOGPROB_FLOOR


# --- sampling parameters ----------------------------------------------------------------------


def ids_of(engine: MlxEngine, prompt: list[int], n: int, **params: Any) -> list[int]:
    return [t.id for t in tokens(engine, prompt, n, decoding(**params))]


def test_seeds_reproduce_with_every_parameter(engine: MlxEngine) -> None:
    prompt = engine.text_tokens("Once upon a time")
    params: dict[str, Any] = {
        "temperature": 1.3,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.01,
        "repeat_penalty": 1.1,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.3,
    }
    grammar = schema_grammar(SMALL_SCHEMA)
    for g in (None, grammar):
        runs = [
            [t.id for t in tokens(engine, prompt, 40, decoding(g, seed=s, **params))]
            for s in (7, 7, 8)
        ]
        assert runs[0] == runs[1] != runs[2]


def test_top_k_and_min_p_keep_the_likely_tokens(engine: MlxEngine) -> None:
    prompt = engine.text_tokens("Once upon a time")
    greedy = ids_of(engine, prompt, 16, temperature=0)
    hot: dict[str, Any] = {"temperature": 2.0}
    assert ids_of(engine, prompt, 16, top_k=1, seed=1, **hot) == greedy
    assert ids_of(engine, prompt, 16, min_p=1.0, seed=1, **hot) == greedy
    for seed in range(4):
        out = tokens(engine, prompt, 16, decoding(None, 3, top_k=3, seed=seed, **hot))
        assert all(t.id in [i for i, _ in t.top] for t in out)
        out = tokens(engine, prompt, 16, decoding(None, 1, min_p=0.2, seed=seed, **hot))
        assert all(
            t.logprob is not None and t.logprob >= t.top[0][1] + np.log(0.2) - 1e-5 for t in out
        )
    # Without the cuts, the same seeds leave those tokens.
    wild = [tokens(engine, prompt, 16, decoding(None, 3, seed=s, **hot)) for s in range(4)]
    assert any(t.id not in [i for i, _ in t.top] for out in wild for t in out)


def test_repeat_penalty_divides_the_repeated_tokens_logits(engine: MlxEngine) -> None:
    prompt = engine.text_tokens("hello hello hello hello")
    greedy = ids_of(engine, prompt, 48, temperature=0)
    penalised = ids_of(engine, prompt, 48, temperature=0, repeat_penalty=3.0)
    assert penalised != greedy and len(set(penalised)) > len(set(greedy))
    # llama.cpp's rule on one step: positive logits divided, negative ones multiplied.
    picker = Picker(decoding(temperature=0, repeat_penalty=2.0), 0, 4)
    picker._generated = [0, 1]
    assert picker.pick(mx.array([[3.0, -1.0, 2.0, 1.0]])).id == 2  # 1.5, -2, 2, 1
    picker = Picker(decoding(temperature=0, frequency_penalty=0.6, presence_penalty=0.5), 0, 3)
    picker._generated = [0, 0, 1]
    assert picker.pick(mx.array([[3.0, 2.0, 1.5]])).id == 2  # 1.3, 0.9, 1.5


def test_logit_bias_moves_tokens(engine: MlxEngine) -> None:
    prompt = engine.text_tokens("Once upon a time")
    greedy = ids_of(engine, prompt, 8, temperature=0)
    forced = engine.text_tokens("the")[0]
    assert ids_of(engine, prompt, 8, temperature=0, logit_bias={forced: 100.0}) == [forced] * 8
    banned = ids_of(engine, prompt, 8, temperature=0, logit_bias={greedy[0]: -100.0})
    assert banned[0] != greedy[0] and greedy[0] not in banned


# --- SmolLM2 (real weights) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_mlx: Path) -> MlxEngine:
    engine = MlxEngine(smollm2_mlx, n_ctx=1024)
    engine.load()
    return engine


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string", "maxLength": 30},
        "height": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": ["fr", "de", "it"]},
        "score": {"type": "number"},
        "notes": {"type": "string", "maxLength": 30},
    },
    "required": [
        "name",
        "age",
        "email",
        "height",
        "active",
        "tags",
        "city",
        "country",
        "score",
        "notes",
    ],
}
ASK = "Describe a person as JSON: name, age, email, height, active, tags, city, country, score."


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_writes_json_that_validates(smollm2: MlxEngine) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    prompt = smollm2.chat_tokens([{"role": "user", "content": ASK}], None)
    out = tokens(smollm2, prompt, 250, decoding(schema_grammar(PERSON), temperature=1.0, seed=0))
    assert smollm2.is_end(out[-1].id)
    jsonschema.validate(json.loads(text(smollm2, out)), PERSON)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_a_tool_call_grammar_with_literal_markers(smollm2: MlxEngine) -> None:
    call = {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
        "required": ["name", "arguments"],
    }
    json_gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(call)).replace("root ::=", "call ::=")
    gbnf = 'root ::= "<tool_call>\\n" call "\\n</tool_call>"\n' + json_gbnf
    ask = "What is the weather in Paris? Call the tool get_weather."
    prompt = smollm2.chat_tokens([{"role": "user", "content": ask}], None)
    out = tokens(smollm2, prompt, 80, decoding(Grammar(gbnf), temperature=0))
    written = text(smollm2, out).decode()
    assert written.startswith("<tool_call>\n") and written.endswith("\n</tool_call>")
    value = json.loads(written.removeprefix("<tool_call>\n").removesuffix("</tool_call>"))
    assert value["name"] == "get_weather" and isinstance(value["arguments"]["city"], str)


def test_smollm2_a_grammar_is_compiled_once(smollm2: MlxEngine) -> None:
    """The vocabulary's llguidance view is built once per model, and a grammar once per text:
    its next task copies it. (What a grammar costs a token, and a new schema the first token,
    is measured side by side with free generation by bench/constrained.py.)"""
    grammars = smollm2.text.grammars
    assert grammars.n_vocab == 49152
    unseen = {"type": "object", "properties": {"never_compiled_yet": {"type": "integer"}}}
    grammar = schema_grammar(unseen)
    assert grammar.gbnf not in grammars._compiled
    smollm2.text.picker(decoding(grammar), 0)
    compiled = grammars._compiled[grammar.gbnf]
    smollm2.text.picker(decoding(grammar), 0)
    assert grammars._compiled[grammar.gbnf] is compiled and smollm2.text.grammars is grammars


def test_long_bounded_repetitions_compile_and_hold(engine: MlxEngine) -> None:
    """llama-cpp-python writes maxLength 40 as 40 nested optionals, deeper than llguidance's
    Lark nests: they are followed as the same bounded repetition."""
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 40},
            "a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 35},
        },
        "required": ["s", "a"],
    }
    grammar = schema_grammar(schema)
    assert grammar.gbnf.count("(char ") >= 39
    constraint = engine.text.grammars.constraint(grammar)
    tok = engine.text._tokenizer
    a, quote = tok.convert_tokens_to_ids(["a", '"'])
    for token in engine.text_tokens('{"s":"') + [a] * 40:
        mask = constraint.allowed()
        assert mask is not None and mask[token]
        constraint.accept(token)
    mask = constraint.allowed()
    assert mask is not None and not mask[a] and mask[quote]
    constraint.accept(quote)
    for token in engine.text_tokens(',"a":[' + ",".join(["1"] * 35)):
        constraint.allowed()
        constraint.accept(token)
    mask = constraint.allowed()
    comma, close = tok.convert_tokens_to_ids([",", "]"])
    assert mask is not None and not mask[comma] and mask[close]

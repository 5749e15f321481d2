"""Stop strings, UTF-8 pieces, limits, cancellation, log-probabilities, prompt scores, reply
parsers (a repeated call, the thinking's tokens), on a scripted token source."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from events.records import SamplingParams, ToolCallDelta
from inference.decoding import Decoding, PromptScores, ThinkingBudget, Token
from inference.generation import ScoredPrompt, Step, check_request, steps
from inference.stops import Emitted, StopMatcher
from structured.parsers import ParserSpec, make_parser
from structured.reasoning import ThinkingStart, thinking_reply
from structured.reply import InvalidRequest, Parsed, PlainReply

END = 0


class Scripted:
    """Plays back fixed token pieces; token i+1 is ``pieces[i]``, END ends."""

    def __init__(self, pieces: list[bytes], end: bool = True) -> None:
        self.pieces = pieces
        self.end = end
        self.generated = 0

    def generate(self, prompt: list[int], decoding: Decoding) -> Iterator[Token | PromptScores]:
        scored = decoding.top_logprobs is not None
        if decoding.echo:
            yield PromptScores(
                tuple(
                    Token(t, None if i == 0 else -0.5, ((END, -0.1),) if i else ())
                    for i, t in enumerate(prompt)
                )
            )
        for i in range(len(self.pieces)):
            self.generated += 1
            yield Token(i + 1, -1.0 * i if scored else None, ((END, -0.1),) if scored else ())
        if self.end:
            yield Token(END)

    def piece(self, token: int) -> bytes:
        return b"<end>" if token == END else self.pieces[token - 1]

    def spelled(self, token: int) -> bytes:
        return b"<|tag|>" if self.piece(token) == b"" else self.piece(token)

    def is_end(self, token: int) -> bool:
        return token == END


def run(source: Scripted, limit: int = 100, stop: list[str] | None = None) -> list[Step]:
    decoding = Decoding(SamplingParams(stop=stop or []))
    out = list(steps(source, [1, 2], decoding, limit, cancelled=lambda: False))
    assert all(isinstance(s, Step) for s in out)
    return [s for s in out if isinstance(s, Step)]


def text(out: list[Step]) -> str:
    return "".join(s.text for s in out)


def test_one_step_per_token_and_a_final_marker() -> None:
    out = run(Scripted([b"Hello", b",", b" world"]))
    assert [s.token_id for s in out] == [1, 2, 3, None]
    assert [s.idx for s in out] == [0, 1, 2, 3]
    assert text(out) == "Hello, world"
    assert out[-1].finish_reason == "stop"


def test_length_limit() -> None:
    out = run(Scripted([b"a", b"b", b"c", b"d"]), limit=2)
    assert [s.token_id for s in out] == [1, 2, None]
    assert out[-1].finish_reason == "length" and text(out) == "ab"


def test_multibyte_characters_split_across_tokens() -> None:
    fish = "🐟".encode()
    out = run(Scripted([b"x", fish[:2], fish[2:], "é".encode()]))
    assert text(out) == "x🐟é"
    assert out[1].text == ""  # half a character is held back, never sent broken


def test_stop_string_across_tokens_is_never_shown() -> None:
    out = run(Scripted([b"Paris", b" is", b"\n", b"\nNext", b" line"]), stop=["\n\n"])
    assert text(out) == "Paris is"
    assert out[-1].finish_reason == "stop"
    assert [s.token_id for s in out] == [1, 2, 3, 4, None]  # tokens up to the stop count


def test_the_stop_string_that_ended_it_is_on_the_final_marker() -> None:
    out = run(Scripted([b"a", b" xy", b"END", b"b"]), stop=["END", "xy"])
    assert text(out) == "a " and out[-1].finish_reason == "stop"
    assert out[-1].stop_sequence == "xy" and all(s.stop_sequence is None for s in out[:-1])
    # Two found in one piece: the one that starts first.
    assert StopMatcher(["END", "xy"]).feed("aENDxy").stop == "END"
    assert StopMatcher(["xy", "END"]).feed("aENDxy").stop == "END"
    # Ended by the end token or by the limit: none.
    assert run(Scripted([b"a"]), stop=["xy"])[-1].stop_sequence is None
    assert run(Scripted([b"a", b"b"]), limit=1, stop=["b"])[-1].stop_sequence is None


def test_held_back_text_that_was_not_a_stop_is_released() -> None:
    out = run(Scripted([b"a", b"\n", b"b"]), stop=["\n\n"])
    assert text(out) == "a\nb"
    out = run(Scripted([b"a", b"\n"]), stop=["\n\n"])
    assert text(out) == "a\n" and out[-1].finish_reason == "stop"


def test_cancel_stops_within_one_token() -> None:
    source = Scripted([b"t"] * 50, end=False)
    seen: list[Step | ScoredPrompt] = []
    gen = steps(source, [1], Decoding(SamplingParams()), 100, cancelled=lambda: len(seen) >= 3)
    for step in gen:
        seen.append(step)
    assert all(isinstance(s, Step) for s in seen)
    assert [s.token_id for s in seen if isinstance(s, Step)] == [1, 2, 3, None]
    assert isinstance(seen[-1], Step) and seen[-1].finish_reason == "cancelled"
    assert source.generated <= 4


def test_an_engine_stopped_during_the_prompt_finishes_as_cancelled() -> None:
    # An engine told to stop between prefill chunks (Decoding.cancelled) ends before any token:
    # the task was cancelled, not cut by its length.
    source = Scripted([], end=False)
    out = list(steps(source, [1], Decoding(SamplingParams()), 100, cancelled=lambda: True))
    assert out == [Step(0, "", None, "cancelled")]
    # The same end without a cancel is the engine's own (its context full): length.
    out = list(steps(source, [1], Decoding(SamplingParams()), 100, cancelled=lambda: False))
    assert out == [Step(0, "", None, "length")]


def test_stop_matcher_directly() -> None:
    m = StopMatcher(["END", "xy"])
    assert m.feed("abE") == Emitted("ab", False)
    assert m.feed("N") == Emitted("", False)
    assert m.feed("Dzz") == Emitted("", True, "END")
    m = StopMatcher(["END"])
    assert m.feed("EN") == Emitted("", False)
    assert m.feed("X") == Emitted("ENX", False)
    assert m.flush() == ""


@pytest.mark.parametrize(
    ("params", "prompt", "message"),
    [
        (SamplingParams(max_tokens=0), 5, "max_tokens"),
        (SamplingParams(temperature=-1), 5, "temperature"),
        (SamplingParams(top_p=0), 5, "top_p"),
        (SamplingParams(presence_penalty=3), 5, "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.5), 5, "frequency_penalty"),
        (SamplingParams(top_k=-1), 5, "top_k"),
        (SamplingParams(min_p=1.5), 5, "min_p"),
        (SamplingParams(repeat_penalty=0), 5, "repeat_penalty"),
        (SamplingParams(logit_bias={7: 101.0}), 5, "logit_bias of token 7"),
        (SamplingParams(), 600, "more than the model's context of 512"),
    ],
)
def test_bad_requests_are_explained(params: SamplingParams, prompt: int, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_request(prompt, params, n_ctx=512)


def test_generation_room() -> None:
    assert check_request(100, SamplingParams(max_tokens=16), n_ctx=512) == 16
    assert check_request(500, SamplingParams(max_tokens=16), n_ctx=512) == 12
    assert check_request(10, SamplingParams(), n_ctx=512) == 502


def test_max_tokens_zero_is_for_scoring_a_prompt() -> None:
    assert check_request(5, SamplingParams(max_tokens=0), n_ctx=512, echo=True) == 0
    source = Scripted([b"a", b"b"])
    out = list(steps(source, [1, 2, 1], Decoding(SamplingParams(), echo=True), 0, lambda: False))
    assert isinstance(out[0], ScoredPrompt)
    assert [t.logprob for t in out[0].tokens] == [None, -0.5, -0.5]
    assert out[1:] == [Step(0, "", None, "length")] and source.generated == 0


def test_logprob_entries_spell_the_text() -> None:
    fish = "🐟".encode()
    source = Scripted([b"x", fish[:2], fish[2:], b" y"])
    decoding = Decoding(SamplingParams(), top_logprobs=1)
    out = [s for s in steps(source, [1], decoding, 100, lambda: False) if isinstance(s, Step)]
    entries = [s.logprob for s in out if s.logprob is not None]
    assert "".join(e.token for e in entries) == "x🐟 y" == "".join(s.text for s in out)
    assert entries[1].token == "" and entries[1].bytes == tuple(fish[:2])
    assert [e.logprob for e in entries] == [0.0, -1.0, -2.0, -3.0]
    assert entries[0].top[0].logprob == -0.1 and entries[0].top[0].bytes == tuple(b"<end>")
    assert out[-1].logprob is None


def test_no_logprobs_unless_asked() -> None:
    assert all(s.logprob is None for s in run(Scripted([b"a", b"b"])))


class Calls:
    """A parser that takes "@" or a special token "<|tag|>" for a tool call and everything
    else for content."""

    markers = frozenset({"<|tag|>"})

    def __init__(self) -> None:
        self.called = False

    def feed(self, text: str) -> Parsed:
        text = text.replace("<|tag|>", "@")
        calls = tuple(ToolCallDelta(index=0, id="c", name="f") for c in text if c == "@")
        self.called = self.called or bool(calls)
        return Parsed(text.replace("@", ""), calls)

    def finish(self) -> Parsed:
        return Parsed("!")


def test_a_reply_with_a_call_finishes_with_tool_calls() -> None:
    out = list(
        steps(
            Scripted([b"hi ", b"@"]), [1], Decoding(SamplingParams()), 100, lambda: False, Calls()
        )
    )
    assert [s.text for s in out if isinstance(s, Step)] == ["hi ", "", "!"]
    last = out[-1]
    assert isinstance(last, Step) and last.finish_reason == "tool_calls"
    assert [s.tool_calls for s in out if isinstance(s, Step)][1][0].name == "f"


def test_a_reply_cut_by_the_limit_is_length_even_with_a_call() -> None:
    out = list(
        steps(
            Scripted([b"@", b"x", b"y"]), [1], Decoding(SamplingParams()), 2, lambda: False, Calls()
        )
    )
    last = out[-1]
    assert isinstance(last, Step) and last.finish_reason == "length"


def test_a_special_token_marker_reaches_the_parser_only() -> None:
    # Token 2's piece is empty: a special token, spelled "<|tag|>".
    out = list(
        steps(Scripted([b"hi", b""]), [1], Decoding(SamplingParams()), 100, lambda: False, Calls())
    )
    assert [s.text for s in out if isinstance(s, Step)] == ["hi", "", "!"]
    assert [len(s.tool_calls) for s in out if isinstance(s, Step)] == [0, 1, 0]
    plain = run(Scripted([b"hi", b""]))
    assert "".join(s.text for s in plain) == "hi"


def test_a_repeated_call_ends_the_reply_and_its_generation() -> None:
    # What SmolLM2 does with several calls allowed: the same call until max_tokens.
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    reply = '{"tool_calls": [' + ", ".join([call] * 10)
    source = Scripted([c.encode() for c in reply], end=False)  # a character a token
    parser = make_parser(ParserSpec("generic", "t", frozenset({"get_time"})))
    out = list(steps(source, [1], Decoding(SamplingParams()), 1000, lambda: False, parser))
    made = [s for s in out if isinstance(s, Step)]
    # The engine was asked for no token after the one that closed the second call.
    assert source.generated == len('{"tool_calls": [' + call + ", " + call)
    assert made[-1].finish_reason == "tool_calls" and made[-1].token_id is None
    deltas = [d for s in made for d in s.tool_calls]
    assert {d.index for d in deltas} == {0}
    assert "".join(d.arguments for d in deltas) == '{"zone": "UTC"}'


def test_the_final_marker_counts_the_thinkings_tokens() -> None:
    pieces = [b"<think>", b"\n", b"Hmm", b".", b"\n", b"</think>", b"\n\n", b"Hi", b"!"]
    cases: list[tuple[ThinkingStart, list[bytes], int]] = [
        ("may_open", pieces, 6),  # <think> to </think>
        ("inside", pieces[2:], 4),  # the prompt opened it
        ("may_open", pieces[6:], 0),  # no thinking
        ("inside", pieces[2:4], 2),  # cut off while thinking: all of it
    ]
    for start, tokens, thinking in cases:
        reply = thinking_reply(PlainReply(), start)
        decoding = Decoding(SamplingParams())
        out = list(steps(Scripted(tokens), [1], decoding, 100, lambda: False, reply))
        last = out[-1]
        assert isinstance(last, Step) and last.reasoning_tokens == thinking, start


# --- a thinking budget ----------------------------------------------------------------------

THINK_PIECES = {1: b"Hmm ", 2: b"\n", 3: b"</think>", 4: b"\n\n", 5: b"Hi", 6: b"<think>"}
CLOSE = (2, 3, 4)  # "\n</think>\n\n"


class Thinker:
    """A model that writes ``script`` (token ids), then thinks on (``Hmm``) until ``limit``;
    at each sample point a forced token (``Decoding.forced``) is taken instead, as the engines
    do. ``ahead``: the next token is picked before the last one is taken (an engine that samples
    ahead of its consumer, as MLX's batch does)."""

    def __init__(self, script: list[int], ahead: bool = False) -> None:
        self.script = script
        self.ahead = ahead
        self.prompts: list[list[int]] = []

    def generate(self, prompt: list[int], decoding: Decoding) -> Iterator[Token]:
        self.prompts.append(prompt)
        script = iter(self.script)

        def pick() -> int:
            forced = decoding.forced.next()
            return forced if forced is not None else next(script, 1)

        picked = pick()
        while True:
            if self.ahead:
                after = pick()
                yield Token(picked)
                picked = after
            else:
                yield Token(picked)
                picked = pick()

    def piece(self, token: int) -> bytes:
        return THINK_PIECES[token]

    def spelled(self, token: int) -> bytes:
        return self.piece(token)

    def is_end(self, token: int) -> bool:
        return token == END


def think(
    source: Thinker,
    budget: int | None,
    start: ThinkingStart = "inside",
    generated: tuple[int, ...] = (),
    limit: int = 12,
) -> tuple[list[int], str, str, int]:
    """The tokens generated, the thinking, the answer and the reasoning tokens."""
    decoding = Decoding(
        SamplingParams(),
        thinking_budget=None if budget is None else ThinkingBudget(budget, CLOSE),
        generated=generated,
    )
    reply = thinking_reply(PlainReply(), start)
    out = [s for s in steps(source, [9], decoding, limit, lambda: False, reply)]
    made = [s for s in out if isinstance(s, Step)]
    tokens = [s.token_id for s in made if s.token_id is not None]
    last = made[-1]
    reasoning = "".join(s.reasoning for s in made)
    return tokens, reasoning, "".join(s.text for s in made), last.reasoning_tokens


def test_a_spent_budget_forces_the_closing_tag_and_the_answer_follows() -> None:
    tokens, reasoning, answer, counted = think(Thinker([1, 1, 1, 1, 1, 1, 1, 5]), budget=3)
    assert tokens[:6] == [1, 1, 1, *CLOSE]
    assert reasoning == "Hmm Hmm Hmm"
    assert answer.startswith("Hmm")  # the model goes on after the tag: its answer
    assert counted == 3 + 2  # the budget, and the forced "\n</think>"


def test_without_a_budget_the_thinking_goes_on() -> None:
    tokens, _, answer, counted = think(Thinker([1] * 20), budget=None)
    assert tokens == [1] * 12 and answer == "" and counted == 12


def test_a_thinking_the_model_ends_within_its_budget_is_left_alone() -> None:
    tokens, _, answer, counted = think(Thinker([1, 1, *CLOSE, 5, 5]), budget=4)
    assert tokens[:7] == [1, 1, *CLOSE, 5, 5] and answer.startswith("HiHi")
    assert counted == 4


def test_a_thinking_the_model_opens_is_budgeted_from_its_tag() -> None:
    tokens, reasoning, _, _ = think(Thinker([6, 1, 1, 1, 1]), 3, "may_open")
    assert tokens[:6] == [6, 1, 1, *CLOSE] and reasoning == "Hmm Hmm"


def test_an_engine_that_samples_ahead_forces_a_token_late() -> None:
    tokens, reasoning, _, _ = think(Thinker([1] * 20, ahead=True), budget=3)
    assert tokens[:7] == [1, 1, 1, 1, *CLOSE] and reasoning == "Hmm Hmm Hmm Hmm"
    # The model closing its thinking itself meanwhile: nothing more is forced after it (the
    # forced token it had taken already is whitespace before the answer).
    tokens, _, answer, _ = think(Thinker([1, 1, 1, 3, 5, 5], ahead=True), 3)
    assert tokens[:7] == [1, 1, 1, 3, 2, 5, 5] and answer.startswith("HiHi"), answer
    assert "</think>" not in answer


def test_a_resumed_task_goes_on_after_the_tokens_forced_before() -> None:
    whole, _, _, counted = think(Thinker([1, 1, 1, 5, 5, 5]), budget=3)
    # Lost within the closing tag: what is left of it is forced, and nothing again; the
    # steps and their count go on as they would have.
    for cut in (3, 4, 5, 6):
        source = Thinker([5, 5, 5])
        tokens, _, _, resumed_counted = think(source, 3, generated=tuple(whole[:cut]))
        assert source.prompts == [[9, *whole[:cut]]]
        assert tokens == whole[cut:] and resumed_counted == counted, cut

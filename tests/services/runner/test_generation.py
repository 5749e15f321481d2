"""Stop strings, UTF-8 pieces, limits and cancellation, on a scripted token source."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.events import SamplingParams
from services.runner.generation import InvalidRequest, Step, check_request, steps
from services.runner.stops import Emitted, StopMatcher

END = 0


class Scripted:
    """Plays back fixed token pieces; token i+1 is ``pieces[i]``, END ends."""

    def __init__(self, pieces: list[bytes], end: bool = True) -> None:
        self.pieces = pieces
        self.end = end
        self.generated = 0

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        for i in range(len(self.pieces)):
            self.generated += 1
            yield i + 1
        if self.end:
            yield END

    def piece(self, token: int) -> bytes:
        return self.pieces[token - 1]

    def is_end(self, token: int) -> bool:
        return token == END


def run(source: Scripted, limit: int = 100, stop: list[str] | None = None) -> list[Step]:
    params = SamplingParams(stop=stop or [])
    return list(steps(source, [1, 2], params, limit, cancelled=lambda: False))


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


def test_held_back_text_that_was_not_a_stop_is_released() -> None:
    out = run(Scripted([b"a", b"\n", b"b"]), stop=["\n\n"])
    assert text(out) == "a\nb"
    out = run(Scripted([b"a", b"\n"]), stop=["\n\n"])
    assert text(out) == "a\n" and out[-1].finish_reason == "stop"


def test_cancel_stops_within_one_token() -> None:
    source = Scripted([b"t"] * 50, end=False)
    seen: list[Step] = []
    gen = steps(source, [1], SamplingParams(), 100, cancelled=lambda: len(seen) >= 3)
    for step in gen:
        seen.append(step)
    assert [s.token_id for s in seen] == [1, 2, 3, None]
    assert seen[-1].finish_reason == "cancelled"
    assert source.generated <= 4


def test_stop_matcher_directly() -> None:
    m = StopMatcher(["END", "xy"])
    assert m.feed("abE") == Emitted("ab", False)
    assert m.feed("N") == Emitted("", False)
    assert m.feed("Dzz") == Emitted("", True)
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

"""What makes two tool calls the same: their names, and their arguments as JSON values."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from structured.repeats import call_key, first_repeat

PARIS = '{"city": "Paris", "unit": "celsius"}'


def test_the_same_arguments_however_written() -> None:
    same = [
        PARIS,
        '{"unit": "celsius", "city": "Paris"}',  # another key order
        '{ "city" :"Paris",\n "unit": "celsius" }',  # other whitespace
        '{"city": "Pa\\u0072is", "unit": "celsius"}',  # an escape
    ]
    assert len({call_key("get_weather", a) for a in same}) == 1
    assert call_key("get_weather", '{"n": 1}') == call_key("get_weather", '{"n": 1.0}')
    assert call_key("get_weather", '{"n": 1}') == call_key("get_weather", '{"n": 1e0}')


def test_other_names_or_values_are_other_calls() -> None:
    key = call_key("get_weather", PARIS)
    assert call_key("get_time", PARIS) != key
    assert call_key("get_weather", '{"city": "Rome", "unit": "celsius"}') != key
    assert call_key("get_weather", '{"city": "Paris"}') != key
    # Python takes True for 1 and 0 for False; JSON does not.
    assert call_key("f", '{"a": true}') != call_key("f", '{"a": 1}')
    assert call_key("f", '{"a": false}') != call_key("f", '{"a": 0}')
    assert call_key("f", '{"a": null}') != call_key("f", '{"a": "null"}')
    assert call_key("f", '{"a": [1, 2]}') != call_key("f", '{"a": [2, 1]}')
    assert call_key("f", '{"a": {"b": 1}}') != call_key("f", '{"a": [["b", 1]]}')
    assert call_key("f", '{"a": "1"}') != call_key("f", '{"a": 1}')


def test_arguments_cut_off_are_no_call_to_repeat() -> None:
    assert call_key("get_weather", '{"city": "Par') is None
    assert call_key("get_weather", "") is None
    assert first_repeat([("f", '{"a": 1'), ("f", '{"a": 1')]) is None


def test_the_first_repeat() -> None:
    w, t = ("get_weather", PARIS), ("get_time", "{}")
    assert first_repeat([]) is None
    assert first_repeat([w, t]) is None
    assert first_repeat([w, w]) == 1
    assert first_repeat([w, t, ("get_time", "{ }"), w]) == 2
    assert first_repeat([w, ("get_weather", '{"unit": "celsius", "city": "Paris"}')]) == 1


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@given(st.dictionaries(st.text(max_size=3), _json, max_size=4), st.data())
def test_a_value_is_its_own_repeat_however_it_is_written(
    arguments: dict[str, object], data: st.DataObject
) -> None:
    keys = data.draw(st.permutations(list(arguments)))
    reordered = {k: arguments[k] for k in keys}
    indent = data.draw(st.sampled_from([None, 0, 2]))
    written = json.dumps(reordered, indent=indent, ensure_ascii=data.draw(st.booleans()))
    assert call_key("f", json.dumps(arguments)) == call_key("f", written)
    assert first_repeat([("f", json.dumps(arguments)), ("f", written)]) == 1

"""Subject names: escaping ids into single tokens, and the shapes of every subject."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from bus.streams import CHUNKS_STREAM, DEADLETTER_STREAM, EVENTS_STREAM, all_subjects, stream_of
from events.catalogue import ChunkGenerated, TaskCreated
from events.subjects import (
    ALL_DEAD_LETTERS,
    ALL_EVENTS,
    CHUNKS_PREFIX,
    DEADLETTER_PREFIX,
    EVENTS_PREFIX,
    TOKENIZER_PREFIX,
    aggregate_filter,
    aggregate_prefix,
    chunk_subject,
    dead_letter_origin,
    deadletter_subject,
    escape_token,
    event_subject,
    event_type_filter,
    tokenizer_subject,
    unescape_token,
)

# What may appear in an escaped token: nothing NATS gives a meaning to.
TOKEN = re.compile(r"^[A-Za-z0-9_\-:=%]+$")


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: '*' is one token, a final '>' is one or more tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return i == len(p) - 1 and len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def test_subject_matcher_itself() -> None:
    assert subject_matches("a.*.c", "a.b.c")
    assert not subject_matches("a.*.c", "a.b.x.c")
    assert subject_matches("a.>", "a.b.c")
    assert not subject_matches("a.>", "a")
    assert not subject_matches("a.b", "a.b.c")


ODD_IDS = [
    "plain",
    "Qwen2.5-0.5B",
    "a.b.c",
    "*",
    ">",
    "a*b>c",
    "with space",
    "tab\there",
    "new\nline",
    "100%",
    "%2E",
    "a%b%%c",
    "ünïcødé",
    "模型",
    "emoji-🐟",
    "slash/and\\back",
    "$JS.API",
    "colon:equals=dash-under_",
    "+plus",
    "..",
    " ",
]


@pytest.mark.parametrize("value", ODD_IDS)
def test_escape_round_trip(value: str) -> None:
    token = escape_token(value)
    assert TOKEN.match(token), token
    assert "." not in token and "*" not in token and ">" not in token
    assert not any(c.isspace() for c in token)
    assert unescape_token(token) == value


def test_escape_round_trip_random() -> None:
    rng = random.Random(7)
    alphabet = "ab.*>% \t-_:=/+é模🐟$#?&\x00"
    for _ in range(2000):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        token = escape_token(value)
        assert TOKEN.match(token), (value, token)
        assert unescape_token(token) == value


def test_safe_characters_pass_unchanged() -> None:
    value = "ABCxyz0189-_:="
    assert escape_token(value) == value


def test_escape_examples() -> None:
    assert escape_token("Qwen2.5-0.5B") == "Qwen2%2E5-0%2E5B"
    assert escape_token("a b") == "a%20b"
    assert escape_token("*") == "%2A"
    assert escape_token(">") == "%3E"
    assert escape_token("%") == "%25"
    assert escape_token("é") == "%C3%A9"  # UTF-8 bytes


def test_escape_is_injective_for_percent_lookalikes() -> None:
    # A literal '%2E' in an id must not collide with an escaped '.'.
    assert escape_token("a.b") != escape_token("a%2Eb")
    ids = ["a.b", "a%2Eb", "a%252Eb", "a_b", "a-b", "a b", "a%20b"]
    assert len({escape_token(i) for i in ids}) == len(ids)


def test_empty_id_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        escape_token("")
    with pytest.raises(ValueError):
        chunk_subject("")
    with pytest.raises(ValueError):
        event_subject("node", ("",), "NodeJoined")
    with pytest.raises(ValueError):
        TaskCreated.filter_for("")
    with pytest.raises(ValueError, match="model_id, task_id"):
        TaskCreated.subject_for("m")
    with pytest.raises(ValueError):
        ChunkGenerated.filter_for("t")


def test_event_subject_shape() -> None:
    subject = event_subject("node", ("node-a",), "NodeJoined")
    assert subject == "shoal.events.node.node-a.NodeJoined"
    assert subject.startswith(EVENTS_PREFIX + ".")


def test_event_subject_model_id_is_one_token() -> None:
    subject = event_subject("task", ("Qwen2.5-0.5B", "task-1"), "TaskCreated")
    assert subject == "shoal.events.task.Qwen2%2E5-0%2E5B.task-1.TaskCreated"
    tokens = subject.split(".")
    assert len(tokens) == 6
    assert unescape_token(tokens[3]) == "Qwen2.5-0.5B"
    assert tokens[-1] == "TaskCreated"


def test_event_subject_ids_with_wildcards_stay_literal() -> None:
    subject = event_subject("node", ("a.>",), "NodeLeft")
    assert len(subject.split(".")) == 5
    assert "*" not in subject and ">" not in subject


def test_chunk_subject_shape() -> None:
    assert chunk_subject("task-1") == "shoal.chunks.task-1"
    assert chunk_subject("t.1 x") == "shoal.chunks.t%2E1%20x"
    assert chunk_subject("t.1").startswith(CHUNKS_PREFIX + ".")
    assert len(chunk_subject("a.b.c").split(".")) == 3


def test_deadletter_subject_shape() -> None:
    assert deadletter_subject("SHOAL_EVENTS") == "shoal.deadletter.SHOAL_EVENTS"
    assert deadletter_subject("SHOAL_CHUNKS").startswith(DEADLETTER_PREFIX + ".")
    assert len(deadletter_subject("x.y").split(".")) == 3


def test_tokenizer_subject_shape() -> None:
    assert tokenizer_subject("Qwen2.5-0.5B") == "shoal.tokenizer.Qwen2%2E5-0%2E5B"
    assert tokenizer_subject("m").startswith(TOKENIZER_PREFIX + ".")
    assert len(tokenizer_subject("a.b.>").split(".")) == 3
    # In no stream: a question to a runner is not stored.
    assert stream_of(tokenizer_subject("m")) is None


def test_a_models_tasks_filter_shape() -> None:
    f = TaskCreated.filter_for("Qwen2.5-0.5B")
    assert f == "shoal.events.task.Qwen2%2E5-0%2E5B.*.TaskCreated"
    assert TaskCreated.filter_for() == "shoal.events.task.*.*.TaskCreated"
    assert TaskCreated.subject_for("m.1", "t") == "shoal.events.task.m%2E1.t.TaskCreated"
    assert ChunkGenerated.subject_for("t.1") == chunk_subject("t.1")


def test_a_models_tasks_filter_matches_only_that_models_created_tasks() -> None:
    model = "Qwen2.5-0.5B"
    f = TaskCreated.filter_for(model)
    assert subject_matches(f, event_subject("task", (model, "t1"), "TaskCreated"))
    assert subject_matches(f, event_subject("task", (model, "a.b"), "TaskCreated"))
    assert not subject_matches(f, event_subject("task", (model, "t1"), "TaskStarted"))
    assert not subject_matches(f, event_subject("task", ("Qwen2", "t1"), "TaskCreated"))
    assert not subject_matches(f, event_subject("task", ("Qwen2.5-0.5B-x", "t1"), "TaskCreated"))
    # A model id that is a prefix-with-dot of another must not match it.
    assert not subject_matches(
        TaskCreated.filter_for("Qwen2"), event_subject("task", (model, "t1"), "TaskCreated")
    )


def test_filters_of_aggregates_types_and_streams() -> None:
    assert aggregate_filter("instance") == "shoal.events.instance.>"
    assert aggregate_filter("instance", "i.1") == "shoal.events.instance.i%2E1.>"
    assert event_type_filter("task", (), 2, "TaskCreated") == "shoal.events.task.*.*.TaskCreated"
    assert event_type_filter("task", ("m",), 2, "Tc") == "shoal.events.task.m.*.Tc"
    assert "shoal.events.task.m.t.TaskStarted".startswith(aggregate_prefix("task"))
    assert dead_letter_origin(deadletter_subject("SHOAL_EVENTS")) == "SHOAL_EVENTS"
    assert dead_letter_origin("shoal.events.node.n.NodeJoined") is None
    assert stream_of(ALL_EVENTS) == EVENTS_STREAM and stream_of(chunk_subject("t")) == CHUNKS_STREAM
    assert stream_of("shoal.other.x") is None
    assert all_subjects(DEADLETTER_STREAM) == ALL_DEAD_LETTERS


REPO = Path(__file__).resolve().parents[2]
# A subject written out by hand: the prefix of a stream in an f-string or a concatenation, or
# an event's subject made from its parts rather than by its class (``TaskStarted.subject_for``).
_HAND_MADE = re.compile(
    r'f"\{(EVENTS|CHUNKS|DEADLETTER|TOKENIZER)_PREFIX\}|_PREFIX \+ "'
    r'|"shoal\.(events|chunks|deadletter|tokenizer)\.'
    r"|\b(event_subject|chunk_subject|event_type_filter)\("
)


def test_subjects_come_only_from_the_catalogue() -> None:
    """Outside events/ (and the tests, which make malformed ones on purpose), subjects are built
    by the catalogue's functions: a rename there reaches every publisher and filter."""
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("bus", "structured", "api", "services", "projectors", "bench", "migrations")
        for path in sorted((REPO / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _HAND_MADE.search(line)
    ]
    assert not found, found

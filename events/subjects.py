"""Subject names of the event log.

Events: ``shoal.events.<aggregate>.<id...>.<EventType>``; chunks: ``shoal.chunks.<task_id>``;
dead letters: ``shoal.deadletter.<stream>``. Ids become subject tokens, so anything NATS gives a
meaning to (``.``, ``*``, ``>``, whitespace) is percent-escaped: ``Qwen2.5-0.5B`` becomes
``Qwen2%2E5-0%2E5B``.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import unquote

EVENTS_PREFIX = "shoal.events"
CHUNKS_PREFIX = "shoal.chunks"
DEADLETTER_PREFIX = "shoal.deadletter"
# A prompt's parts, stored once by digest (bus/stores/parts.py): shoal.parts.<sha256>.
PARTS_PREFIX = "shoal.parts"
# Everything on one stream.
ALL_EVENTS = f"{EVENTS_PREFIX}.>"
ALL_CHUNKS = f"{CHUNKS_PREFIX}.>"
ALL_DEAD_LETTERS = f"{DEADLETTER_PREFIX}.>"
# A runner asking which node holds some weight files: core NATS request-reply, in no stream
# (services/models/weight_offers.py).
WEIGHTS_WANTED = "shoal.weights.wanted"
# Asking a chat runner of a model about its tokenizer (tokenize, detokenize, count a chat's
# prompt): core NATS request-reply to ``shoal.tokenizer.<model_id>``, answered by one runner of
# the queue group, in no stream (events/tokenizer.py).
TOKENIZER_PREFIX = "shoal.tokenizer"
TOKENIZER_QUEUE = "tokenizers"

# What an event is about: the token after ``shoal.events`` (chunks have a stream of their own).
Aggregate = Literal[
    "node", "model", "instance", "runner", "task", "response", "key", "chunk", "log"
]

# Letters, digits, '-', '_' , ':' and '=' pass unchanged; everything else is %XX (UTF-8 bytes).
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-:=]")


def escape_token(value: str) -> str:
    """Make ``value`` usable as one subject token, reversibly."""
    if not value:
        raise ValueError("an id used in a subject must not be empty")
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), value)


def unescape_token(token: str) -> str:
    return unquote(token)


def event_subject(aggregate: Aggregate, ids: tuple[str, ...], event_type: str) -> str:
    tokens = ".".join(escape_token(i) for i in ids)
    return f"{EVENTS_PREFIX}.{aggregate}.{tokens}.{event_type}"


def chunk_subject(task_id: str) -> str:
    return f"{CHUNKS_PREFIX}.{escape_token(task_id)}"


def tokenizer_subject(model_id: str) -> str:
    """Where a model's chat runners answer questions about its tokenizer."""
    return f"{TOKENIZER_PREFIX}.{escape_token(model_id)}"


def deadletter_subject(stream: str) -> str:
    return f"{DEADLETTER_PREFIX}.{escape_token(stream)}"


def aggregate_filter(aggregate: Aggregate, *ids: str) -> str:
    """Every event of an aggregate (``shoal.events.instance.>``), or of one of its members
    (``shoal.events.instance.<id>.>``)."""
    return ".".join([EVENTS_PREFIX, aggregate, *(escape_token(i) for i in ids), ">"])


def aggregate_prefix(aggregate: Aggregate) -> str:
    """What the subjects of an aggregate's events start with."""
    return f"{EVENTS_PREFIX}.{aggregate}."


def event_type_filter(
    aggregate: Aggregate, ids: tuple[str, ...], n_ids: int, event_type: str
) -> str:
    """Every event of one type about the members named by ``ids``, the leading ones of its
    ``n_ids`` (the rest any): ``shoal.events.task.<model>.*.TaskCreated``."""
    wild = ("*",) * (n_ids - len(ids))
    return ".".join([EVENTS_PREFIX, aggregate, *(escape_token(i) for i in ids), *wild, event_type])


def dead_letter_origin(subject: str) -> str | None:
    """The stream a dead letter's subject names (``shoal.deadletter.<stream>``), or None."""
    if not subject.startswith(f"{DEADLETTER_PREFIX}."):
        return None
    return unescape_token(subject.rsplit(".", 1)[-1])

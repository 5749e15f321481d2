"""Authentication fails closed (api/keys.py): once a key was made, an API never falls back to
anonymous access, however many keys are revoked, nor when its projection was rebuilt before it
reached the ``KeyAdded``: the log says so. A real nats-server and a real SQLite projection."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from api.errors import ApiError
from api.keys import ANONYMOUS, KeyBook, key_digest, principal_or_refusal, resolve
from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.streams import ensure_streams
from events.catalogue import KeyAdded
from projectors import database
from projectors.rows import KeyRow
from projectors.tables import api_keys

TS = datetime(2026, 1, 1, tzinfo=UTC)
KEY = "sk-shoal-" + "1" * 64


def test_no_key_ever_made_is_open_and_one_ever_made_is_closed() -> None:
    assert resolve(b"", frozenset(), {}) is ANONYMOUS
    assert resolve(b"", frozenset(), {}, ever_made=True) is None
    assert resolve(KEY.encode(), frozenset(), {}, ever_made=True) is None  # revoked
    refused = principal_or_refusal("", frozenset(), {}, ever_made=True)
    assert isinstance(refused, ApiError) and refused.status == 401


async def _projection(tmp_path: Path, revoked: bool | None) -> AsyncEngine:
    engine = database.create_engine(f"sqlite:///{tmp_path / 'shoal.db'}")
    await database.upgrade(engine)
    if revoked is not None:
        row = KeyRow("k1", "alice", "user", key_digest(KEY), added_at=TS)
        values = asdict(row) | {"revoked_at": TS if revoked else None}
        async with engine.begin() as conn:
            await conn.execute(api_keys.insert().values(**values))
    return engine


async def test_the_last_key_revoked_leaves_the_api_closed(tmp_path: Path) -> None:
    """Once, revoking the last key made every request, the revoked key's included, an admin."""
    engine = await _projection(tmp_path, revoked=True)
    try:
        book = KeyBook()
        made = await book.keys(engine)
        assert made == {} and book.ever_made
        who = principal_or_refusal(f"{KEY}", frozenset(), made, book.ever_made)
        assert isinstance(who, ApiError) and who.status == 401
        assert isinstance(principal_or_refusal("", frozenset(), made, book.ever_made), ApiError)
    finally:
        await engine.dispose()


async def test_a_projection_rebuilt_before_the_key_is_closed_by_the_log(
    tmp_path: Path, js: JetStreamContext
) -> None:
    """A new, empty projection: the log is asked, and holds a KeyAdded."""
    engine = await _projection(tmp_path, revoked=None)
    try:
        book = KeyBook()
        assert await book.keys(engine, js) == {} and not book.ever_made  # nothing made: open
        added = KeyAdded(key_id="k1", origin="cli", name="alice", digest=key_digest(KEY))
        await Publisher(js).publish(added)
        book = KeyBook()
        assert await book.keys(engine, js) == {} and book.ever_made
        assert resolve(b"", frozenset(), {}, book.ever_made) is None
    finally:
        await engine.dispose()


async def test_a_log_that_cannot_answer_for_a_moment_leaves_the_last_answer(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    """Once, every request through every API of a keyless cluster was a 503 while the log's
    stream elected a leader (a NATS server lost): each read of the keys asked the log anew.
    The last answer stands; before any answer, it is still a 503."""
    engine = await _projection(tmp_path, revoked=None)
    nc = await connect(nats_server.url, name="test")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        book = KeyBook(ttl_s=0.0)
        assert await book.keys(engine, js) == {} and not book.ever_made  # open
        await nc.close()  # the log cannot be asked now
        assert await book.keys(engine, js) == {} and not book.ever_made  # still open
        with pytest.raises(ApiError) as refused:
            await KeyBook().keys(engine, js)  # never answered: it cannot tell
        assert refused.value.status == 503
    finally:
        await nc.close()
        await engine.dispose()

"""Stored responses of the Responses API, on the log: written as ``ResponseStored`` (a later
one replaces an earlier) and ``ResponseDeleted``, read from the projection's ``responses`` table
(so any API process serves them, and ``shoal replay`` rebuilds them), or from the log itself
when the projector has not written the latest yet: a GET right after the POST, on another API
process, finds the response all the same.

A response too large for one NATS message (1 MiB by default: its output, input items and the
conversation so far) is answered but not stored: a warning in the API's log, and the answer
says ``"store": false``.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import nats.errors
from nats.js.errors import NotFoundError
from pydantic import ValidationError
from sqlalchemy import select

from api import keys
from api.context import ApiContext
from api.errors import ApiError
from api.serving import log_unavailable
from bus.payload import PayloadTooLargeError
from bus.stores.claim_check import response_checked_in, response_resolved
from bus.stores.parts import PartMissing
from bus.streams import EVENTS_STREAM
from events.catalogue import ResponseDeleted, ResponseStored, parse_event, utc_now
from events.records import ChatMessage
from projectors.rows import ResponseRow, TaskRow
from projectors.tables import responses, tasks

log = logging.getLogger(__name__)

# How long a delete waits for the projection to show it.
DELETE_SEEN_WITHIN_S = 5.0

# A response in one of these states changes no more (but for a cancel that came too late).
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})
ACTIVE = frozenset({"queued", "in_progress"})


async def store(ctx: ApiContext, event: ResponseStored) -> bool:
    """Put ``event`` on the log, its conversation and input items as parts (stored once, by
    digest), with its expiry; False (and a warning) when it could not be."""
    try:
        event = await response_checked_in(ctx.parts, event)
        if event.expires_at is None and ctx.config.response_ttl_s > 0:
            expires = event.ts + timedelta(seconds=ctx.config.response_ttl_s)
            event = event.model_copy(update={"expires_at": expires})
        await ctx.publish(event)
    except PayloadTooLargeError as exc:
        log.warning("response %s is not stored: %s", event.response_id, exc)
        return False
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning(
            "response %s is not stored: the log is unavailable (%r)", event.response_id, exc
        )
        return False
    return True


async def delete(ctx: ApiContext, response_id: str) -> None:
    """Delete it on the log, and return once the projection shows it deleted (within a few
    seconds): a finished response is read from the projection alone, so a read that followed
    the delete on any API process would otherwise still find it."""
    try:
        await ctx.publish(ResponseDeleted(response_id=response_id, origin=ctx.origin))
    except (nats.errors.Error, TimeoutError) as exc:
        raise log_unavailable(exc) from exc
    deadline = asyncio.get_running_loop().time() + DELETE_SEEN_WITHIN_S
    while asyncio.get_running_loop().time() < deadline:
        row = await _row(ctx, response_id)
        # No row yet is not "deleted": the projector may write the stored one next.
        if row is not None and row.deleted_at is not None:
            return
        await asyncio.sleep(0.05)


async def find(ctx: ApiContext, response_id: str) -> ResponseStored | None:
    """The response as last stored; None for one never stored, deleted, expired (which the
    planner deletes on the log soon: services/planner/janitor.py), or another key's."""
    found = await _find(ctx, response_id)
    if found is not None and found.expires_at is not None and found.expires_at <= utc_now():
        return None
    if found is not None and not keys.current().sees(found.owner):
        return None  # another key's: as a missing one
    return found


async def whole(ctx: ApiContext, stored: ResponseStored) -> ResponseStored:
    """``stored`` with its conversation and input items read back from their parts."""
    try:
        return await response_resolved(ctx.parts, stored)
    except (nats.errors.Error, TimeoutError) as exc:
        raise log_unavailable(exc) from exc
    except PartMissing as exc:
        raise ApiError(
            404,
            f"response {stored.response_id} is no longer whole: {exc}",
            code="response_not_found",
        ) from exc


async def _find(ctx: ApiContext, response_id: str) -> ResponseStored | None:
    row = await _row(ctx, response_id)
    if row is not None and (row.deleted_at is not None or row.status in FINISHED):
        return None if row.deleted_at is not None else _from_row(row)
    # Not written yet, or still running: the log may know more than the projection.
    try:
        deleted, latest = await _from_log(ctx, response_id)
    except (nats.errors.Error, TimeoutError) as exc:
        if row is not None:
            return _from_row(row)
        raise log_unavailable(exc) from exc
    if deleted:
        return None
    if latest is not None:
        return latest
    # Gone from the log (its retention), kept by the projection.
    return _from_row(row) if row is not None else None


async def task(ctx: ApiContext, task_id: str) -> TaskRow | None:
    async with ctx.engine.connect() as conn:
        found = (await conn.execute(select(tasks).where(tasks.c.task_id == task_id))).mappings()
        row = found.first()
    return TaskRow(**row) if row is not None else None


async def _row(ctx: ApiContext, response_id: str) -> ResponseRow | None:
    query = select(responses).where(responses.c.response_id == response_id)
    async with ctx.engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return ResponseRow(**row) if row is not None else None


def _from_row(row: ResponseRow) -> ResponseStored:
    return ResponseStored(
        response_id=row.response_id,
        origin="projection",
        task_id=row.task_id,
        model_id=row.model_id,
        status=row.status,
        response=row.response or {},
        input_items=row.input_items or [],
        conversation=[ChatMessage.model_validate(m) for m in row.conversation or []],
        conversation_ref=row.conversation_ref,
        input_items_ref=row.input_items_ref,
        expires_at=row.expires_at,
        owner=row.owner,
    )


async def _from_log(ctx: ApiContext, response_id: str) -> tuple[bool, ResponseStored | None]:
    """Whether the log has the response deleted, and its latest ``ResponseStored``."""
    js = ctx.nc.jetstream()

    async def last(kind: type[ResponseStored | ResponseDeleted]) -> bytes | None:
        try:
            msg = await js.get_last_msg(EVENTS_STREAM, kind.subject_for(response_id))
        except NotFoundError:
            return None
        return msg.data or b""

    if await last(ResponseDeleted) is not None:
        return True, None
    data = await last(ResponseStored)
    if data is None:
        return False, None
    try:
        event = parse_event(data)
    except ValidationError:
        return False, None
    return False, event if isinstance(event, ResponseStored) else None

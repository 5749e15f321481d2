"""Stored Responses: stored and deleted."""

from __future__ import annotations

from typing import Any

from events.catalogue import (
    ResponseDeleted,
    ResponseStored,
)
from events.records import PartRef
from projectors.rows import (
    ResponseRow,
)
from projectors.state import Change, ClusterState, Put


def response_stored(state: ClusterState, e: ResponseStored) -> list[Change]:
    old = state.response(e.response_id)
    if old is not None and old.deleted_at is not None:
        return []  # deleted stays deleted (a background response that ended afterwards)
    row = ResponseRow(
        response_id=e.response_id,
        status=e.status,
        task_id=e.task_id,
        model_id=e.model_id,
        created_at=old.created_at if old is not None else e.ts,
        updated_at=e.ts,
        response=dict(e.response),
        input_items=list(e.input_items),
        conversation=[m.model_dump(mode="json") for m in e.conversation],
        conversation_ref=_dumped(e.conversation_ref),
        input_items_ref=_dumped(e.input_items_ref),
        expires_at=e.expires_at,
        owner=old.owner if old is not None else e.owner,  # whoever made it first
    )
    return [Put(row)]


def response_deleted(state: ClusterState, e: ResponseDeleted) -> list[Change]:
    old = state.response(e.response_id)
    if old is not None and old.deleted_at is not None:
        return []
    # Only the id, task and times are kept: what was said is gone.
    row = ResponseRow(
        response_id=e.response_id,
        status="deleted",
        task_id=old.task_id if old is not None else "",
        model_id=old.model_id if old is not None else "",
        created_at=old.created_at if old is not None else e.ts,
        updated_at=e.ts,
        deleted_at=e.ts,
        owner=old.owner if old is not None else None,
    )
    return [Put(row)]


def _dumped(ref: PartRef | None) -> dict[str, Any] | None:
    return ref.model_dump() if ref is not None else None

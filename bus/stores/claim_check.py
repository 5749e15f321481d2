"""A task's messages and tools stored as parts before its ``TaskCreated`` is published, and
read back by whoever needs them whole (the runner, ``shoal events dump``); a stored response's
conversation and input items likewise. ``bus/stores/parts.py`` says how parts are stored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bus.payload import PayloadTooLargeError
from bus.stores.parts import Part, PartStore, PartTooLarge, chain, oversized, ref_of
from events.catalogue import ResponseStored, TaskCreated
from events.records import ChatMessage, Tool


class TooLarge(PayloadTooLargeError):
    """A message or tool of a task too large for one NATS message: ``field`` and ``index`` say
    which."""

    def __init__(self, field: str, part: PartTooLarge) -> None:
        super().__init__(f"{field}[{part.index}]", part.size, part.limit)
        self.field = field
        self.index = part.index


@dataclass(frozen=True)
class Staged:
    """A task as it goes on the log, naming its parts, and the parts it names by field."""

    task: TaskCreated
    parts: dict[str, list[Part]] = field(default_factory=dict)

    def too_large(self, limit: int) -> TooLarge | None:
        """The first message or tool larger than a NATS message may be (``limit``)."""
        for name, parts in self.parts.items():
            if (found := oversized(parts, limit)) is not None:
                return TooLarge(name, found)
        return None

    def all_parts(self) -> list[Part]:
        return [p for parts in self.parts.values() for p in parts]


def _dumped(values: list[Any]) -> list[Any]:
    return [v.model_dump(mode="json") for v in values]


def staged(task: TaskCreated) -> Staged:
    """``task`` naming its messages and tools as parts, and the parts (pure: nothing stored)."""
    update: dict[str, Any] = {}
    parts: dict[str, list[Part]] = {}
    if task.messages:
        parts["messages"] = chain(_dumped(task.messages))
        update |= {"messages": None, "messages_ref": ref_of(parts["messages"])}
    if task.tools:
        parts["tools"] = chain(_dumped(task.tools))
        update |= {"tools": [], "tools_ref": ref_of(parts["tools"])}
    return Staged(task.model_copy(update=update) if update else task, parts)


async def checked_in(store: PartStore, task: TaskCreated) -> TaskCreated:
    """``task`` naming its messages and tools as parts, stored now (those not stored yet).
    Raises TooLarge for a message or tool too large to be stored."""
    out = staged(task)
    if (too_large := out.too_large(store.limit)) is not None:
        raise too_large
    await store.store(out.all_parts())
    return out.task


async def resolved(store: PartStore, task: TaskCreated) -> TaskCreated:
    """``task`` with the messages and tools it names as parts in it (``PartMissing`` when they
    are gone)."""
    update: dict[str, Any] = {}
    if task.messages_ref is not None:
        messages = [ChatMessage.model_validate(v) for v in await store.get(task.messages_ref)]
        update |= {"messages": messages, "messages_ref": None}
    if task.tools_ref is not None:
        tools = [Tool.model_validate(v) for v in await store.get(task.tools_ref)]
        update |= {"tools": tools, "tools_ref": None}
    return task.model_copy(update=update) if update else task


async def _put(store: PartStore, name: str, values: list[Any]) -> Any:
    try:
        return await store.put(values)
    except PartTooLarge as exc:
        raise TooLarge(name, exc) from None


async def response_checked_in(store: PartStore, stored: ResponseStored) -> ResponseStored:
    """``stored`` naming its conversation and input items as parts (TooLarge when one is too
    large to be stored)."""
    update: dict[str, Any] = {}
    if stored.conversation:
        conversation = await _put(store, "conversation", _dumped(stored.conversation))
        update |= {"conversation": [], "conversation_ref": conversation}
    if stored.input_items:
        items = await _put(store, "input_items", stored.input_items)
        update |= {"input_items": [], "input_items_ref": items}
    return stored.model_copy(update=update) if update else stored


async def response_resolved(store: PartStore, stored: ResponseStored) -> ResponseStored:
    """``stored`` with its conversation and input items in it."""
    update: dict[str, Any] = {}
    if stored.conversation_ref is not None:
        values = await store.get(stored.conversation_ref)
        conversation = [ChatMessage.model_validate(v) for v in values]
        update |= {"conversation": conversation, "conversation_ref": None}
    if stored.input_items_ref is not None:
        update |= {"input_items": await store.get(stored.input_items_ref), "input_items_ref": None}
    return stored.model_copy(update=update) if update else stored

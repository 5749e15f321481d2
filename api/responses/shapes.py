"""The Responses API's response objects and stream events, made from a task's chunks: output
items (a thinking model's ``reasoning``, with its thinking as ``reasoning_text`` content and no
summary; an assistant ``message`` with ``output_text``; ``function_call``s), usage, status, and
the semantic events of a stream (``response.created`` ... ``response.completed``), each with its
``sequence_number``. Pure, but for the clock of ``completed_at``; ``ResponsesOut`` is told how
to keep a finished response (api/responses/routes.py stores it on the log).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from api.errors import ApiError
from api.reply import Call, Reply
from api.serving import Output, sse
from api.task_stream import TaskStream
from events.catalogue import ChunkGenerated
from events.records import ChatMessage, ToolCall, ToolCallDelta, Usage
from events.states import ResponseStatus

Json = dict[str, Any]
# Keeps a response (its object, and the assistant's turn for a conversation that continues
# it, once there is one); says whether it was kept.
Keep = Callable[[Json, ChatMessage | None], Awaitable[bool]]

# How a stream ends, by the response's status.
_LAST_EVENT: dict[str, str] = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",  # the SDK's events have no response.cancelled
    "failed": "response.failed",
}


@dataclass(frozen=True)
class Head:
    """What every object of one response repeats: its ids, model and the request's settings
    (``ResponsesRequest.echoed``)."""

    response_id: str
    task_id: str
    model: str
    created_at: int
    settings: Json = field(default_factory=dict)
    # A namespace's function's name -> its namespace, which its calls' items name.
    namespaces: dict[str, str] = field(default_factory=dict)

    def response(
        self,
        status: ResponseStatus,
        output: list[Json],
        usage: Json | None = None,
        error: Json | None = None,
        incomplete: Json | None = None,
        completed_at: int | None = None,
    ) -> Json:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": completed_at,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.settings,
        }


def message_id(task_id: str, n: int = 0) -> str:
    return f"msg_{task_id}" + (f"_{n}" if n else "")


def reasoning_id(task_id: str) -> str:
    return f"rs_{task_id}"


def reasoning_part(text: str) -> Json:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str, status: str) -> Json:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [reasoning_part(text)],
        "status": status,
    }


def call_item_id(task_id: str, index: int) -> str:
    return f"fc_{task_id}_{index}"


def text_part(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> Json:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [text_part(text)],
    }


def call_item(item_id: str, call: Call, status: str, namespace: str | None = None) -> Json:
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }
    return item | ({"namespace": namespace} if namespace is not None else {})


def usage(u: Usage) -> Json:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


def error_code(err: ApiError) -> str:
    """The code of a failed response's error (the SDK's ``ResponseError`` names a few)."""
    return "invalid_prompt" if err.status == 400 else "server_error"


def status_of(reply: Reply) -> tuple[ResponseStatus, Json | None, Json | None]:
    """A finished reply's status, ``incomplete_details`` and ``error``."""
    if reply.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reply.finish_reason == "cancelled":
        return "cancelled", None, None
    if reply.finish_reason == "error":
        return "failed", None, {"code": "server_error", "message": "the generation failed"}
    return "completed", None, None


def output_items(
    task_id: str, reply: Reply, reasoning: bool = True, namespaces: dict[str, str] | None = None
) -> list[Json]:
    """A whole reply's output: its thinking (``reasoning``: when shown, and there was some),
    its text as a message (even an empty one, when it called nothing), then its calls (each
    with its function's namespace, if it has one); the last item is ``incomplete`` when
    max_output_tokens cut it."""
    spaces = namespaces or {}
    items = []
    if reasoning and reply.reasoning:
        items.append(reasoning_item(reasoning_id(task_id), reply.reasoning, "completed"))
    if reply.text or not reply.calls:
        items.append(message_item(message_id(task_id), reply.text, "completed"))
    for index, call in sorted(reply.calls.items()):
        item_id = call_item_id(task_id, index)
        items.append(call_item(item_id, call, "completed", spaces.get(call.name)))
    if reply.finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def final_response(head: Head, output: list[Json], reply: Reply, u: Usage) -> Json:
    status, incomplete, error = status_of(reply)
    done_at = int(time.time()) if status == "completed" else None
    return head.response(status, output, usage(u), error, incomplete, done_at)


def failed_response(head: Head, err: ApiError, output: list[Json] | None = None) -> Json:
    error = {"code": error_code(err), "message": err.message}
    return head.response("failed", output or [], error=error)


def assistant_message(output: list[Json]) -> ChatMessage:
    """The assistant's turn in a response's output, for the conversation a later request
    continues (``previous_response_id``)."""
    text = "".join(
        p.get("text", "") for item in output if item["type"] == "message" for p in item["content"]
    )
    thought = "".join(
        p.get("text", "") for item in output if item["type"] == "reasoning" for p in item["content"]
    )
    calls = [
        ToolCall(id=i["call_id"], name=i["name"], arguments=i["arguments"])
        for i in output
        if i["type"] == "function_call"
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls, reasoning=thought or None)


class ResponseStream:
    """A streamed response's output items as its chunks arrive, and the events saying so: an
    item is added, written (text or arguments deltas) and done before the next one starts."""

    def __init__(self, head: Head, reasoning: bool = True) -> None:
        self.head = head
        self._reasoning = reasoning  # whether the thinking is shown
        self.items: list[Json] = []
        self.started = False
        self._seq = 0
        self._current: int | None = None  # the item being written, by its output index
        self._calls: dict[int, int] = {}  # a call's index -> its output index
        self._messages = 0

    def _event(self, kind: str, **fields: Any) -> str:
        # Written at once: the items mutated later are sent as they are now.
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(payload, event=kind)

    def start(self) -> str:
        if self.started:
            return ""
        self.started = True
        r = self.head.response("in_progress", [])
        return self._event("response.created", response=r) + self._event(
            "response.in_progress", response=r
        )

    def feed(self, chunk: ChunkGenerated) -> str:
        out = self._think(chunk.reasoning) if chunk.reasoning and self._reasoning else ""
        out += self._text(chunk.text) if chunk.text else ""
        return out + "".join(self._call(d) for d in chunk.tool_calls)

    def _think(self, text: str) -> str:
        out = ""
        i = self._current
        if i is None or self.items[i]["type"] != "reasoning":
            out = self._close("completed")
            item: Json = {
                "type": "reasoning",
                "id": reasoning_id(self.head.task_id),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            i = self._current = len(self.items)
            self.items.append(item)
            out += self._event("response.output_item.added", output_index=i, item=item)
            part = reasoning_part("")
            item["content"].append(part)
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                part=part,
            )
        item = self.items[i]
        item["content"][0]["text"] += text
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=item["id"],
            output_index=i,
            content_index=0,
            delta=text,
        )

    def _open_message(self) -> str:
        out = self._close("completed")
        item: Json = {
            "type": "message",
            "id": message_id(self.head.task_id, self._messages),
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self._messages += 1
        i = self._current = len(self.items)
        self.items.append(item)
        out += self._event("response.output_item.added", output_index=i, item=item)
        part = text_part("")
        item["content"].append(part)
        return out + self._event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=i,
            content_index=0,
            part=part,
        )

    def _text(self, text: str) -> str:
        out = ""
        if self._current is None or self.items[self._current]["type"] != "message":
            out = self._open_message()
        i = self._current
        assert i is not None
        item = self.items[i]
        item["content"][0]["text"] += text
        return out + self._event(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=i,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call(self, d: ToolCallDelta) -> str:
        out = ""
        i = self._calls.get(d.index)
        if i is None:
            out = self._close("completed")
            item: Json = {
                "type": "function_call",
                "id": call_item_id(self.head.task_id, d.index),
                "call_id": d.id or "",
                "name": d.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            if (namespace := self.head.namespaces.get(d.name or "")) is not None:
                item["namespace"] = namespace
            i = self._current = self._calls[d.index] = len(self.items)
            self.items.append(item)
            out += self._event("response.output_item.added", output_index=i, item=item)
        item = self.items[i]
        if not d.arguments:
            return out
        item["arguments"] += d.arguments
        return out + self._event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=i,
            delta=d.arguments,
        )

    def _close(self, status: str) -> str:
        i = self._current
        if i is None:
            return ""
        self._current = None
        item = self.items[i]
        item["status"] = status
        if item["type"] == "function_call":
            out = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                arguments=item["arguments"],
                name=item["name"],
            )
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out = self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=part["text"],
            )
            out += self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                part=part,
            )
        else:
            part = item["content"][0]
            out = self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                part=part,
            )
        return out + self._event("response.output_item.done", output_index=i, item=item)

    def finish(self, reply: Reply) -> str:
        """The events that end the output (``items`` is then the response's output)."""
        out = self.start()
        if all(item["type"] == "reasoning" for item in self.items):
            # nothing was said: an empty message, as a whole response has
            out += self._open_message()
        return out + self._close("incomplete" if reply.finish_reason == "length" else "completed")

    def last(self, response: Json) -> str:
        return self._event(
            _LAST_EVENT.get(response["status"], "response.completed"), response=response
        )

    def fail(self, err: ApiError) -> str:
        out = self.start() + self._close("incomplete")
        return out + self.last(failed_response(self.head, err, self.items))


class ResponsesOut(Output):
    """The Responses API's answer, whole or streamed; ``keep`` (None: ``store`` false) is told
    of the finished response before the client gets its end, and a response it could not keep
    says ``"store": false``."""

    too_large_param = "input"

    def __init__(
        self, head: Head, streaming: bool, keep: Keep | None, reasoning: bool = True
    ) -> None:
        self.head = head
        self._streaming = streaming
        self._keep = keep
        self._reasoning = reasoning
        self._stream = ResponseStream(head, reasoning)
        self._tail = ""
        self.final: Json | None = None

    def opening(self, ts: TaskStream, index: int) -> str:
        return self._stream.start()

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        return "".join(self._stream.feed(c) for c in group)

    async def done(self, replies: list[Reply], usages: list[Usage]) -> None:
        reply = replies[0]
        if self.server_limit is not None and reply.finish_reason == "length":
            # Cut by the server's limit, not one it asked for: complete, as llama-server's
            # answer is (Codex, which sets none, takes an incomplete one for a failure).
            reply = replace(reply, finish_reason="stop")
        if self._streaming:
            self._tail = self._stream.finish(reply)
            output = self._stream.items
        else:
            output = output_items(self.head.task_id, reply, self._reasoning, self.head.namespaces)
        self.final = final_response(self.head, output, reply, usages[0])
        if self._keep is not None and not await self._keep(self.final, assistant_message(output)):
            self.final["store"] = False

    def closing(self, replies: list[Reply], usages: list[Usage]) -> str:
        assert self.final is not None
        return self._tail + self._stream.last(self.final)

    def failure(self, err: ApiError) -> str:
        return self._stream.fail(err)

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        assert self.final is not None
        return self.final

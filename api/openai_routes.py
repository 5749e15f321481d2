"""The OpenAI-compatible endpoints: chat completions, completions, models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import nats.errors
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from api import projection
from api.context import ApiContext, context, require_key
from api.errors import ApiError, error_body
from api.schemas import ChatCompletionRequest, CompletionRequest
from api.task_stream import TaskStream
from bus.events import ChunkGenerated, TaskCreated, new_id
from bus.payload import PayloadTooLargeError, check_size
from bus.publisher import MSG_ID_HEADER

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]

# What a runner's finish reason is called in OpenAI's vocabulary.
_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "error": "stop"}


@router.get("/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    """Models known to the cluster, in OpenAI's list shape."""
    state = await projection.cluster(ctx.engine)
    return {
        "object": "list",
        "data": [
            {"id": m.model_id, "object": "model", "owned_by": "shoal",
             "created": int(m.added_at.timestamp()) if m.added_at else 0}
            for m in sorted(state.models(), key=lambda m: m.model_id)
        ],
    }  # fmt: skip


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, ctx: Ctx
) -> JSONResponse | StreamingResponse:
    # A valid request is most often answered by api/fast_lane.py, through serve_chat() too.
    return await serve_chat(ctx, body)


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, ctx: Ctx) -> JSONResponse | StreamingResponse:
    return await serve_completion(ctx, body)


async def serve_chat(
    ctx: ApiContext, body: ChatCompletionRequest
) -> JSONResponse | StreamingResponse:
    task = TaskCreated(
        task_id=new_id(), model_id=body.model, origin=ctx.origin, kind="chat",
        messages=body.chat_messages(), params=body.sampling(), user=body.user,
    )  # fmt: skip
    return await _serve(ctx, task, body.stream, body.include_usage, chat=True)


async def serve_completion(
    ctx: ApiContext, body: CompletionRequest
) -> JSONResponse | StreamingResponse:
    task = TaskCreated(
        task_id=new_id(), model_id=body.model, origin=ctx.origin, kind="completion",
        prompt=body.text(), params=body.sampling(), user=body.user,
    )  # fmt: skip
    return await _serve(ctx, task, body.stream, body.include_usage, chat=False)


async def _serve(
    ctx: ApiContext, task: TaskCreated, stream: bool, include_usage: bool, chat: bool
) -> JSONResponse | StreamingResponse:
    _require_storable(ctx, task)
    if not ctx.serving.fresh(task.model_id):
        state = await projection.serving(ctx.engine, task.model_id, ctx.reader)
        projection.require_serving(state, task.model_id)
        ctx.serving.found(task.model_id)
    shape = _Shape(task, chat)
    if stream:
        # The task is stored before the response starts: the runner gets it ~1 ms sooner than
        # after the streaming machinery's start, and a log that cannot store it gets a 503.
        ts = _stream(ctx, task)
        try:
            await ts.__aenter__()
        except nats.errors.Error as exc:
            raise _log_unavailable(exc) from exc
        return _TaskEvents(ts, _events(ctx, ts, shape, include_usage))
    try:
        async with _stream(ctx, task) as ts:
            text = "".join([c.text async for c in ts.chunks()])
    except nats.errors.Error as exc:  # the task could not be stored
        raise _log_unavailable(exc) from exc
    ctx.metrics.task_served(ts)
    finished = ts.finished
    assert finished is not None
    if finished.unavailable is not None:
        raise _unavailable(finished.unavailable)
    if finished.failed is not None:
        raise _task_error(finished.failed.error)
    assert finished.completed is not None
    return JSONResponse(shape.whole(text, finished.completed.finish_reason, finished.completed))


class _TaskEvents(StreamingResponse):
    """The server-sent events of a task whose stream is open (its ``TaskCreated`` stored). The
    stream is closed however the response ends; one that ends before its last event (the
    client went away) cancels the task."""

    def __init__(self, ts: TaskStream, events: AsyncIterator[str]) -> None:
        self._ts = ts
        self._sent_all = False
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._noting_the_end(events), media_type="text/event-stream",
                         headers=headers)  # fmt: skip

    async def _noting_the_end(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async for event in events:
            yield event
        self._sent_all = True

    async def stream_response(self, send: Send) -> None:
        """The headers go out with the first event (the first token, with the assistant's
        role before it), not before: sent while the runner processes the prompt, they and the
        client's reading of them took CPU from it (~1.5 ms of its time to first token on 2
        cores); a client still learns at once that a request was refused (4xx, 503)."""
        held: list[Message] = []

        async def send_with_first_body(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)
                return
            while held:
                await send(held.pop())
            await send(message)

        await super().stream_response(send_with_first_body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed: BaseException | None = None
        try:
            await super().__call__(scope, receive, send)
        except BaseException as exc:
            failed = exc
            raise
        finally:
            # Starlette ends the response of a client that went away without an exception.
            if failed is None and not self._sent_all:
                failed = ConnectionResetError("the client went away")
            await self._ts.__aexit__(type(failed) if failed else None, failed, None)


async def _events(
    ctx: ApiContext, ts: TaskStream, shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    """The task's server-sent events, from the open stream ``ts``, to ``data: [DONE]``. A
    chat's first event (the assistant's role) goes out with the next one, in the same write,
    and so does the last one with the ``[DONE]``."""
    unsent = _sse(shape.chunk({"role": "assistant", "content": ""}, None)) if shape.chat else ""
    try:
        # One event per chunk, but one write per group of chunks that came together: fewer
        # writes and wake-ups for the API and the client.
        async for group in ts.chunk_groups():
            events = [_sse(shape.piece(c)) for c in group if c.text or c.finish_reason]
            if events:
                yield unsent + "".join(events)
                unsent = ""
    except TimeoutError:
        ts.finished = None
        yield unsent + _sse(error_body(504, "the task took longer than the API waits")) + _DONE
        return
    ctx.metrics.task_served(ts)
    finished = ts.finished
    assert finished is not None
    if finished.unavailable is not None or finished.failed is not None:
        err = (
            _unavailable(finished.unavailable)
            if finished.unavailable is not None
            else _task_error(finished.failed.error if finished.failed else "")
        )
        unsent += _sse(error_body(err.status, err.message, code=err.code))
    elif finished.completed is not None and include_usage:
        unsent += _sse(shape.usage_chunk(finished.completed))
    yield unsent + _DONE


def _stream(ctx: ApiContext, task: TaskCreated) -> TaskStream:
    async def recheck() -> str | None:
        try:
            state = await projection.serving(ctx.engine, task.model_id, ctx.reader)
            projection.require_serving(state, task.model_id)
        except ApiError as err:
            return err.message
        return None

    return TaskStream(ctx.nc, task, ctx.origin, ctx.config.task_timeout_s, recheck,
                      on_published=ctx.metrics.event_published)  # fmt: skip


def _unavailable(why: str) -> ApiError:
    return ApiError(503, f"{why} (the request was accepted, then its last runner stopped)",
                    code="model_not_ready")  # fmt: skip


def _require_storable(ctx: ApiContext, task: TaskCreated) -> None:
    """A request whose task is larger than a NATS message may be is refused with a 413 here:
    sent, the server would close the API's connection."""
    try:
        check_size(ctx.nc.jetstream(), task.subject, task.to_json(),
                   {MSG_ID_HEADER: task.event_id})  # fmt: skip
    except PayloadTooLargeError as exc:
        raise ApiError(
            413,
            f"The request is too large: as a task on the event log it is {exc.size} bytes,"
            f" more than the {exc.limit} bytes a NATS message may hold. Shorten the prompt.",
            param="messages" if task.kind == "chat" else "prompt",
            code="request_too_large",
        ) from None


def _log_unavailable(exc: Exception) -> ApiError:
    why = f"the event log did not store the request ({type(exc).__name__}): NATS JetStream"
    return ApiError(503, f"{why} is unavailable; try again", code="log_unavailable")


def _task_error(error: str) -> ApiError:
    # The runner rejects requests it cannot serve (prompt longer than the context...) with
    # a message meant for the caller: that is a bad request, anything else a server error.
    if error.startswith("invalid request"):
        return ApiError(400, error, code="invalid_request")
    return ApiError(500, f"the task failed: {error}", code="task_failed")


_DONE = "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Shape:
    """OpenAI's response objects for one task (chat or text completion)."""

    def __init__(self, task: TaskCreated, chat: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{task.task_id}"
        self.model = task.model_id
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None,
                  "finish_reason": finish}  # fmt: skip
        return self._head("text_completion") | {"choices": [choice]}

    def piece(self, c: ChunkGenerated) -> dict[str, Any]:
        finish = _FINISH[c.finish_reason] if c.finish_reason else None
        return self.chunk({"content": c.text} if c.text else {}, finish)

    def usage_chunk(self, done: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": _usage(done)}

    def whole(self, text: str, finish_reason: str, done: Any) -> dict[str, Any]:
        finish = _FINISH[finish_reason]
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            return self._head("chat.completion") | {"choices": [choice], "usage": _usage(done)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._head("text_completion") | {"choices": [choice], "usage": _usage(done)}


def _usage(done: Any) -> dict[str, int]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}  # fmt: skip

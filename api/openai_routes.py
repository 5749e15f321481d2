"""The OpenAI-compatible endpoints: chat completions, completions, models."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol

import nats.errors
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from api import projection
from api.context import ApiContext, context, require_key
from api.errors import ApiError, error_body
from api.openai_shapes import (
    FINISH,
    Echo,
    Reply,
    Shape,
    chat_chunk,
    chat_completion,
    completion,
    completion_chunk,
)
from api.schemas import ChatCompletionRequest, CompletionRequest, choice_params
from api.task_stream import TaskStream
from bus.events import ChunkGenerated, TaskCreated, Usage, new_id
from bus.payload import PayloadTooLargeError, check_size
from bus.publisher import MSG_ID_HEADER

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


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
        **body.task_fields(),
    )  # fmt: skip
    shape = Shape(f"chatcmpl-{task.task_id}", task.model_id, chat=True)
    out = _ChatOut(shape, bool(body.logprobs))
    return await _serve(ctx, _choices(task, body.n), body.stream, body.include_usage, out)


async def serve_completion(
    ctx: ApiContext, body: CompletionRequest
) -> JSONResponse | StreamingResponse:
    task = TaskCreated(
        task_id=new_id(), model_id=body.model, origin=ctx.origin, kind="completion",
        prompt=body.text(), prompt_token_ids=body.token_ids(), params=body.sampling(),
        user=body.user, **body.task_fields(),
    )  # fmt: skip
    shape = Shape(f"cmpl-{task.task_id}", task.model_id, chat=False)
    out = _CompletionOut(shape, body.logprobs is not None, body.echo, body.text())
    return await _serve(ctx, _choices(task, body.n), body.stream, body.include_usage, out)


def _choices(task: TaskCreated, n: int) -> list[TaskCreated]:
    """A request for ``n`` choices is ``n`` tasks, each with its own seed (``choice_params``);
    only the first scores the prompt, which the choices share."""
    return [task] + [
        task.model_copy(update={"task_id": new_id(), "event_id": new_id(), "echo": False,
                                "params": choice_params(task.params, i)})
        for i in range(1, n)
    ]  # fmt: skip


async def _serve(
    ctx: ApiContext, tasks: list[TaskCreated], stream: bool, include_usage: bool, out: _Output
) -> JSONResponse | StreamingResponse:
    _require_storable(ctx, tasks[0])
    model = tasks[0].model_id
    if not ctx.serving.fresh(model):
        state = await projection.serving(ctx.engine, model, ctx.reader)
        projection.require_serving(state, model)
        ctx.serving.found(model)
    if stream:
        # The tasks are stored before the response starts: the runner gets one ~1 ms sooner
        # than after the streaming machinery's start, and a log that cannot store it gets a
        # 503.
        streams: list[TaskStream] = []
        try:
            for task in tasks:
                ts = _stream(ctx, task)
                await ts.__aenter__()
                streams.append(ts)
        except nats.errors.Error as exc:
            for ts in streams:
                await ts.__aexit__(type(exc), exc, None)
            raise _log_unavailable(exc) from exc
        return _TaskEvents(streams, _events(ctx, streams, out, include_usage))
    try:
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(_stream(ctx, t)) for t in tasks]
            replies = await asyncio.gather(*(_reply(ts) for ts in streams))
    except nats.errors.Error as exc:  # a task could not be stored
        raise _log_unavailable(exc) from exc
    usages = []
    for ts in streams:
        ctx.metrics.task_served(ts)
        finished = ts.finished
        assert finished is not None
        if finished.unavailable is not None:
            raise _unavailable(finished.unavailable)
        if finished.failed is not None:
            raise _task_error(finished.failed.error)
        assert finished.completed is not None
        usages.append(finished.completed.usage)
    return JSONResponse(out.whole(replies, usages, streams[0]))


async def _reply(ts: TaskStream) -> Reply:
    reply = Reply()
    async for chunk in ts.chunks():
        reply.add(chunk)
    return reply


class _Output(Protocol):
    """What one endpoint makes of its tasks' chunks."""

    shape: Shape

    def opening(self, ts: TaskStream, index: int) -> str:
        """What goes out before a choice's first chunk."""
        ...

    def events(self, index: int, group: list[ChunkGenerated]) -> str: ...

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any: ...


class _ChatOut:
    def __init__(self, shape: Shape, logprobs: bool) -> None:
        self.shape = shape
        self._logprobs = logprobs

    def opening(self, ts: TaskStream, index: int) -> str:
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
        return _sse(self.shape.head("chat.completion.chunk") | {"choices": [role]})

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        # One event per chunk, each as the client would get it alone.
        made = (chat_chunk(self.shape, index, [c], False, self._logprobs) for c in group)
        return "".join(_sse(m) for m in made if m is not None)

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        return chat_completion(self.shape, replies, usages, self._logprobs)


class _CompletionOut:
    def __init__(self, shape: Shape, logprobs: bool, echo: bool, prompt: str | None) -> None:
        self.shape = shape
        self._logprobs = logprobs
        self._echo = echo
        self._prompt = prompt
        self._offsets: dict[int, int] = {}  # per choice, where its next token's text starts

    def _echoed(self, ts: TaskStream) -> Echo | None:
        if not self._echo:
            return None
        scores = ts.prompt_scores
        text = self._prompt if self._prompt is not None else "".join(t.token for t in scores or [])
        return Echo(text, scores if self._logprobs else None)

    def _start(self, echo: Echo | None) -> int:
        if echo is not None:
            return 0
        return len(self._prompt) if self._prompt is not None else 0

    def opening(self, ts: TaskStream, index: int) -> str:
        echo = self._echoed(ts)
        self._offsets[index] = self._start(echo)
        if echo is None:
            return ""
        # Offsets count the tokens' texts, as the whole response's do.
        self._offsets[index] = sum(len(t.token) for t in echo.scores or []) or len(echo.text)
        entries = (echo.scores or []) if self._logprobs else None
        return _sse(completion_chunk(self.shape, index, echo.text, entries, 0, None))

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        out = []
        for c in group:
            if not (c.text or c.finish_reason or c.logprob):
                continue
            entries = ([c.logprob] if c.logprob else []) if self._logprobs else None
            finish = FINISH[c.finish_reason] if c.finish_reason else None
            offset = self._offsets.get(index, 0)
            out.append(_sse(completion_chunk(self.shape, index, c.text, entries, offset, finish)))
            self._offsets[index] = offset + (len(c.logprob.token) if c.logprob else len(c.text))
        return "".join(out)

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        echo = self._echoed(first)
        return completion(self.shape, replies, usages, self._logprobs, echo, self._start(echo))


class _TaskEvents(StreamingResponse):
    """The server-sent events of tasks whose streams are open (their ``TaskCreated`` stored).
    The streams are closed however the response ends; ending before the last event (the
    client went away) cancels the tasks."""

    def __init__(self, streams: list[TaskStream], events: AsyncIterator[str]) -> None:
        self._streams = streams
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
            for ts in self._streams:
                await ts.__aexit__(type(failed) if failed else None, failed, None)


async def _groups(streams: list[TaskStream]) -> AsyncIterator[tuple[int, list[ChunkGenerated]]]:
    """Each stream's chunk groups as they come, with the stream's index; one stream is read
    directly (the common case, on the path of every token), several through a queue."""
    if len(streams) == 1:
        async for group in streams[0].chunk_groups():
            yield 0, group
        return
    queue: asyncio.Queue[tuple[int, list[ChunkGenerated] | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, ts: TaskStream) -> None:
        try:
            async for group in ts.chunk_groups():
                queue.put_nowait((i, group))
        except BaseException as exc:
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, None))

    pumps = [asyncio.ensure_future(pump(i, ts)) for i, ts in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for p in pumps:
            p.cancel()


async def _events(
    ctx: ApiContext, streams: list[TaskStream], out: _Output, include_usage: bool
) -> AsyncIterator[str]:
    """The tasks' server-sent events, to ``data: [DONE]``. A choice's opening (a chat's role)
    goes out with its first chunk, in the same write, and so does the last event with the
    ``[DONE]``."""
    opened: set[int] = set()
    unsent = ""
    try:
        # One event per chunk, but one write per group of chunks that came together: fewer
        # writes and wake-ups for the API and the client.
        async for i, group in _groups(streams):
            if i not in opened:
                opened.add(i)
                unsent += out.opening(streams[i], i)
            events = out.events(i, group)
            if events:
                yield unsent + events
                unsent = ""
    except TimeoutError:
        for ts in streams:
            ts.finished = None
        yield unsent + _sse(error_body(504, "the task took longer than the API waits")) + _DONE
        return
    usages = []
    for ts in streams:
        ctx.metrics.task_served(ts)
        finished = ts.finished
        assert finished is not None
        if finished.unavailable is not None or finished.failed is not None:
            err = (
                _unavailable(finished.unavailable)
                if finished.unavailable is not None
                else _task_error(finished.failed.error if finished.failed else "")
            )
            yield unsent + _sse(error_body(err.status, err.message, code=err.code)) + _DONE
            return
        if finished.completed is not None:
            usages.append(finished.completed.usage)
    if include_usage:
        unsent += _sse(out.shape.usage_chunk(usages))
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
            param=_largest_part(task),
            code="request_too_large",
        ) from None


def _largest_part(task: TaskCreated) -> str:
    """The field that made a task too large: its prompt, messages, or the tools' schemas
    (which count too)."""
    if task.kind == "completion":
        return "prompt"
    tools = sum(len(t.model_dump_json()) for t in task.tools)
    return "tools" if tools > sum(len(m.content) for m in task.messages or []) else "messages"


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

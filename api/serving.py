"""A request's tasks served, whatever the dialect: each dialect's routes build the tasks and an
``Output`` (what the dialect makes of chunks), and ``serve`` does the rest, the same for all:
it checks that the model can answer, stores the tasks on the log, follows their chunks and
outcome, and answers whole or as a stream. There is one serving path; a dialect only
translates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import nats.errors
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from api import admission, keys, on_demand, projection, refusals
from api.admission import Permit
from api.context import ApiContext
from api.errors import ApiError, Dialect, dialect_of, error_response
from api.images.placed import NO_IMAGES, Images
from api.metrics import ApiMetrics
from api.output_limit import default_max_tokens, with_default_max_tokens
from api.rate_limit import retry_after
from api.reply import Reply
from api.task_stream import LOST, Closed, Recheck, TaskStream
from api.thinking import with_default_budget
from bus.payload import PayloadTooLargeError, check_size, max_payload
from bus.publisher import MSG_ID_HEADER
from bus.stores import claim_check
from bus.stores.claim_check import Staged
from events.catalogue import ChunkGenerated, EmbeddingsRequested, EventBase, TaskCreated, TaskFailed
from events.kinds import InstanceRole
from events.records import Usage
from structured.schema_checks import schemas_problem, task_schemas

TaskT = TypeVar("TaskT", TaskCreated, EmbeddingsRequested)


class Output(ABC):
    """What one dialect makes of its tasks' chunks; one instance per request. A stream is
    ``opening`` (per task, before its first chunk), ``events`` (per group of chunks that came
    together), then ``closing`` or ``failure``; a whole answer is ``whole``."""

    media_type = "text/event-stream"
    # The request's field named by the 413 of a task too large for the log (None: the task's
    # own largest part, as OpenAI's chat and completions call it).
    too_large_param: str | None = None
    # The limit ``serve`` gave tasks whose request set none (api/output_limit.py), or None.
    server_limit: int | None = None

    def opening(self, ts: TaskStream, index: int) -> str:
        return ""

    @abstractmethod
    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        """The stream's events for chunks of task ``index`` that came together."""

    def closing(self, replies: list[Reply], usages: list[Usage]) -> str:
        return ""

    @abstractmethod
    def failure(self, err: ApiError) -> str:
        """The end of a stream that failed after it started (its status is sent already)."""

    @abstractmethod
    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        """The whole answer (JSON) of the tasks' replies."""

    async def done(self, replies: list[Reply], usages: list[Usage]) -> None:  # noqa: B027
        """Optional: told once the tasks completed, streamed or not (for a dialect that keeps
        its answers)."""


async def serve(
    ctx: ApiContext,
    tasks: list[TaskCreated],
    stream: bool,
    out: Output,
    images: Images = NO_IMAGES,
) -> JSONResponse | StreamingResponse:
    """Serve ``tasks`` (one per choice: they share the model) with ``out``; a refusal before
    anything is sent raises ``ApiError``, which the app renders in the path's dialect.
    ``images``: those the tasks' messages name (``api/images/loading.py``), stored with them."""
    # Its messages and tools go on the log as parts (bus/stores/parts.py), the task names them: each
    # must fit in a NATS message, as must the task. So do its images (bus/stores/images.py).
    tasks = [owned(t) for t in tasks]  # its own: only it (and admins) see it
    tasks = [with_default_budget(t, ctx.config.reasoning_budget) for t in tasks]
    if (limit := await default_max_tokens(ctx, tasks[0])) is not None:
        out.server_limit, tasks = limit, [with_default_max_tokens(t, limit) for t in tasks]
    require_schemas(tasks[0])
    stage = staged(ctx, tasks[0], out.too_large_param)
    # A model loaded for it takes the request's own keep-alive (Ollama's), as its task will.
    permit = await gate(ctx, tasks[0].model_id, len(tasks), keep_alive_s=tasks[0].keep_alive_s)
    try:
        try:
            await ctx.parts.store([*images.parts, *stage.all_parts()])
        except (nats.errors.Error, TimeoutError) as exc:
            raise log_unavailable(exc) from exc
        shared = {k: getattr(stage.task, k) for k in _NAMED_AS_PARTS}
        tasks = [stage.task, *(t.model_copy(update=shared) for t in tasks[1:])]
        return await _serve(ctx, tasks, stream, out, permit)
    except BaseException:
        permit.close()  # the slots of tasks whose streams did not close them
        raise


_NAMED_AS_PARTS = ("messages", "messages_ref", "tools", "tools_ref")


def require_schemas(task: TaskCreated) -> None:
    """The 400 of a request whose schemas (its tools' and its response format's), each
    within bounds, are together too much to turn into grammars (naming the one past it)."""
    found = schemas_problem(task_schemas(task.tools, task.response_format))
    if found is not None:
        raise ApiError(400, found[1], param=found[0], code="schema_too_large")


def staged(ctx: ApiContext, task: TaskCreated, param: str | None = None) -> Staged:
    """``task`` as it goes on the log, naming its messages and tools as parts (the choices of
    one request share them); a 413 when a message, a tool or the task is too large for a NATS
    message."""
    stage = claim_check.staged(task)
    if (too_large := stage.too_large(max_payload(ctx.nc.jetstream()))) is not None:
        raise ApiError(
            413,
            f"The request is too large: {too_large.subject} is {too_large.size} bytes stored,"
            f" more than the {too_large.limit} bytes a NATS message may hold. Shorten it.",
            param=param or too_large.field,
            code="request_too_large",
        )
    require_storable(ctx, stage.task, param)
    return stage


async def _serve(
    ctx: ApiContext, tasks: list[TaskCreated], stream: bool, out: Output, permit: Permit
) -> JSONResponse | StreamingResponse:
    if stream:
        # The tasks are stored before the response starts: the runner gets one without waiting
        # for the streaming machinery's start, and a log that cannot store it gets a 503.
        streams: list[TaskStream] = []
        try:
            for task in tasks:
                ts = task_stream(ctx, task, permit.task_done)
                await ts.__aenter__()
                streams.append(ts)
        except nats.errors.Error as exc:
            for ts in streams:
                await ts.__aexit__(type(exc), exc, None)
            raise log_unavailable(exc) from exc
        return TaskEvents(streams, _events(ctx, streams, out), out.media_type, ctx.metrics)
    try:
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(task_stream(ctx, t, permit.task_done))
                for t in tasks
            ]
            replies = await asyncio.gather(*(_reply(ts) for ts in streams))
    except nats.errors.Error as exc:  # a task could not be stored
        raise log_unavailable(exc) from exc
    usages = _outcomes(ctx, streams)
    await out.done(replies, usages)
    return JSONResponse(out.whole(replies, usages, streams[0]))


async def gate(
    ctx: ApiContext,
    model_id: str,
    tasks: int = 1,
    role: InstanceRole = "chat",
    keep_alive_s: float | None = None,
    why: str = "",
) -> Permit:
    """The one gate every inference request passes before its work is published, whatever
    its dialect or kind (chat, completion, embeddings, rerank): the key's requests and tokens
    a minute (429), the model serving in ``role`` (loaded on demand where the key may, 404,
    403 or 503 otherwise), and a place among its slots (admission: a 429 when the queue is
    full). Its tasks carry the key as their owner (``owned``): what they use is the key's, in
    ``shoal keys list`` and ``/metrics``."""
    capacity = await checked(ctx, model_id, role, keep_alive_s, why)
    # Before anything is published or sent: a full queue is a 429 a stream gets too. Each
    # role's instances have slots of their own.
    return await admit(ctx, admission_name(model_id, role), tasks, capacity)


async def checked(
    ctx: ApiContext,
    model_id: str,
    role: InstanceRole = "chat",
    keep_alive_s: float | None = None,
    why: str = "",
) -> int:
    """The gate's checks, without a slot (a tokenizer question, answered in milliseconds by a
    runner, takes none): the key's limits, then the model serving; its serving slots."""
    require_within_limits(ctx, keys.current())
    on_demand.require_may_keep(ctx.config, model_id, keep_alive_s)
    return await require_serving(ctx, model_id, role, why, keep_alive_s)


async def would_pass(ctx: ApiContext, model_id: str, role: InstanceRole = "chat") -> None:
    """The refusal the gate would give a request now, without counting it or taking a slot:
    asked before work done for the request alone (fetching its image URLs)."""
    who = keys.current()
    if who.key_id is not None and ctx.rate_limits.would_refuse(
        who.key_id, who.requests_per_minute, who.tokens_per_minute
    ):
        require_within_limits(ctx, who)  # the 429, counted as one refused
    capacity = await require_serving(ctx, model_id, role)
    name = admission_name(model_id, role)
    if (refused := ctx.admission.refusal(name, 1, capacity)) is not None:
        raise refused


def admission_name(model_id: str, role: InstanceRole) -> str:
    """The name a model's requests in ``role`` queue under (its chat ones, by its id)."""
    return model_id if role == "chat" else f"{model_id} ({role})"


def owned(task: TaskT) -> TaskT:
    """``task`` owned by the request's key (none for an API's own keys or none)."""
    who = keys.current()
    return task if who.key_id is None else task.model_copy(update={"owner": who.key_id})


def used(ctx: ApiContext, tokens: int, who: keys.Principal | None = None) -> None:
    """Tokens the request's task used, for its key's tokens a minute (``who``: the request's
    key, where this runs outside the request's context)."""
    who = who if who is not None else keys.current()
    if who.key_id is not None:
        ctx.rate_limits.used(who.key_id, tokens)


async def require_serving(
    ctx: ApiContext,
    model_id: str,
    role: InstanceRole = "chat",
    why: str = "",
    keep_alive_s: float | None = None,
) -> int:
    """The 404, 400 or 503 of a model that cannot answer now in ``role`` (its yes remembered
    a moment); else its serving slots (the capacity admission control lets run at once). A
    model the cluster knows that nothing serves in ``role`` is loaded on demand first, unless
    the API was told not to (``api/on_demand.py``); ``why``: the request, for the log;
    ``keep_alive_s``: the instance's keep-alive, when one is loaded."""
    slots = ctx.serving.slots(model_id, role)
    if slots is None:
        state = await projection.serving(ctx.engine, model_id, ctx.reader)
        try:
            projection.require_serving(state, model_id, role)
        except ApiError as err:
            if not ctx.config.load_on_demand or err.code not in on_demand.LOADABLE:
                raise
            why = why or f"loaded on demand: a {role} request for {model_id}"
            await on_demand.load(ctx, model_id, role, why, keep_alive_s)
            state = await projection.serving(ctx.engine, model_id, ctx.reader)
            projection.require_serving(state, model_id, role)
        slots = projection.serving_slots(state, model_id, role)
        ctx.serving.found(model_id, role, slots)
    return slots


async def admit(ctx: ApiContext, model_id: str, tasks: int, capacity: int) -> Permit:
    """A place for a request's ``tasks`` tasks among the model's ``capacity`` slots, waiting
    in this API's queue if they are taken (api/admission.py); a full queue is a 429."""
    permit = await ctx.admission.enter(
        model_id, tasks, capacity, admission.CALLER.get(), ctx.config.task_timeout_s
    )
    ctx.metrics.queue_waited(model_id, permit.ticket.waited_s)
    return permit


def _outcomes(ctx: ApiContext, streams: list[TaskStream]) -> list[Usage]:
    """The tasks' usages, or the error of the first that did not complete."""
    usages = []
    for ts in streams:
        ctx.metrics.task_served(ts)
        finished = ts.finished
        assert finished is not None
        if finished.unavailable is not None:
            raise unavailable(finished.unavailable)
        if finished.lost is not None:
            raise request_lost()
        if finished.failed is not None:
            raise failure_error(finished.failed)
        assert finished.completed is not None
        usages.append(finished.completed.usage)
    return usages


async def _reply(ts: TaskStream) -> Reply:
    reply = Reply()
    async for chunk in ts.chunks():
        reply.add(chunk)
    return reply


class Refused(Exception):
    """A stream's tasks failed before it sent anything: its answer is still the error's own
    status (a prompt too long for the context is a 400, as a client expects it before any
    event)."""

    def __init__(self, err: ApiError) -> None:
        super().__init__(err.message)
        self.err = err


class TaskEvents(StreamingResponse):
    """The streamed answer of tasks whose streams are open (their ``TaskCreated`` stored).
    The streams are closed however the response ends; ending before the last event (the
    client went away) cancels the tasks. Tasks that fail before their first event are answered
    with the error's status and body instead (``Refused``)."""

    def __init__(
        self,
        streams: list[TaskStream],
        events: AsyncIterator[str],
        media_type: str,
        metrics: ApiMetrics,
    ) -> None:
        self._streams = streams
        self._metrics = metrics
        self._scope: Scope = {}
        self._sent_all = False
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._noting_the_end(events), media_type=media_type, headers=headers)

    async def _noting_the_end(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async for event in events:
            yield event
        self._sent_all = True

    async def stream_response(self, send: Send) -> None:
        """The headers go out with the first event (the first token, with the assistant's
        role before it), not before: sent while the runner processes the prompt, they and the
        client's reading of them took CPU from it, out of its time to first token; a client
        still learns at once that a request was refused (4xx, 503)."""
        held: list[Message] = []

        async def send_with_first_body(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)
                return
            while held:
                await send(held.pop())
            await send(message)

        try:
            await super().stream_response(send_with_first_body)
        except Refused as refused:
            if not held:  # pragma: no cover - refused only before the first event
                raise
            self._sent_all = True
            refusals.note(self._metrics, self._scope, refused.err)
            answer = error_response(refused.err, dialect_of(str(self._scope.get("path", ""))))
            start = {"type": "http.response.start", "status": answer.status_code}
            await send(start | {"headers": answer.raw_headers})
            await send({"type": "http.response.body", "body": answer.body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
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


async def _events(ctx: ApiContext, streams: list[TaskStream], out: Output) -> AsyncIterator[str]:
    """The tasks' streamed events to the dialect's end. A task's opening goes out with its
    first chunk, in the same write, and so does the last event with the closing."""
    opened: set[int] = set()
    replies = [Reply() for _ in streams]
    unsent = ""
    sent = False  # nothing sent yet: a failure is the response's own status (Refused)
    try:
        # One event per chunk, but one write per group of chunks that came together: fewer
        # writes and wake-ups for the API and the client.
        async for i, group in _groups(streams):
            if i not in opened:
                opened.add(i)
                unsent += out.opening(streams[i], i)
            for chunk in group:
                replies[i].add(chunk)
            events = out.events(i, group)
            if events:
                yield unsent + events
                unsent, sent = "", True
    except TimeoutError:
        for ts in streams:
            ts.finished = None
        late = ApiError(504, "the task took longer than the API waits")
        if not sent:
            raise Refused(late) from None
        yield unsent + out.failure(late)
        return
    try:
        usages = _outcomes(ctx, streams)
    except ApiError as err:
        if not sent:
            raise Refused(err) from None
        yield unsent + out.failure(err)
        return
    await out.done(replies, usages)
    yield unsent + out.closing(replies, usages)


def task_stream(ctx: ApiContext, task: TaskCreated, on_closed: Closed | None = None) -> TaskStream:
    why_not = recheck(ctx, task.model_id)
    who = keys.current()  # closed may be called from another task

    def closed() -> None:
        if on_closed is not None:
            on_closed()
        done = ts.finished.completed if ts.finished is not None else None
        if done is not None:  # for the key's tokens a minute
            used(ctx, done.usage.total_tokens, who)

    ts = TaskStream(
        ctx.nc,
        task,
        ctx.origin,
        ctx.config.task_timeout_s,
        why_not,
        on_published=ctx.metrics.event_published,
        on_closed=closed,
        log_wait_s=ctx.config.log_wait_s,
    )
    return ts


def require_within_limits(ctx: ApiContext, who: keys.Principal) -> None:
    """A key over its requests or tokens a minute gets a 429 with Retry-After."""
    if who.key_id is None:
        return
    wait = ctx.rate_limits.refusal(who.key_id, who.requests_per_minute, who.tokens_per_minute)
    if wait is not None:
        raise ApiError(
            429,
            f"Rate limit reached for key {who.name!r}: at most {who.requests_per_minute}"
            f" requests and {who.tokens_per_minute} tokens a minute. Try again in"
            f" {retry_after(wait)} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry_after(wait)},
        )


def recheck(ctx: ApiContext, model_id: str, role: InstanceRole = "chat") -> Recheck:
    """Why a task of ``model_id`` in ``role`` should stop waiting, asked afresh (None: it may
    wait): a task whose chunks stopped coming (none yet, or its runner lost) asks it now and
    then. It waits while the model serves, and for ``resume_within_s`` while it is coming back
    (a runner restarting, an instance placed anew); not for a model that cannot come back."""
    down_since: float | None = None

    async def why_not() -> str | None:
        nonlocal down_since
        state = await projection.serving(ctx.engine, model_id, ctx.reader)
        try:
            projection.require_serving(state, model_id, role)
        except ApiError as err:
            now = time.monotonic()
            down_since = down_since if down_since is not None else now
            waited = now - down_since
            if waited < ctx.config.resume_within_s and projection.coming_back(
                state, model_id, role
            ):
                return None
            return err.message + (f" for {waited:.0f} s" if waited >= 1 else "")
        down_since = None
        return None

    return why_not


def unavailable(why: str) -> ApiError:
    return ApiError(
        503,
        f"{why} (the request was accepted, then its last runner stopped)",
        code="model_not_ready",
    )


def request_lost() -> ApiError:
    return ApiError(503, LOST, code="request_lost")


def require_storable(
    ctx: ApiContext, event: EventBase, param: str | None = None, advice: str = "Shorten the prompt."
) -> None:
    """A request whose task is larger than a NATS message may be is refused with a 413 here:
    sent, the server would close the API's connection. ``param``: the request's field that
    made it large (for a ``TaskCreated``, found from the task)."""
    try:
        check_size(
            ctx.nc.jetstream(), event.subject, event.to_json(), {MSG_ID_HEADER: event.event_id}
        )
    except PayloadTooLargeError as exc:
        if param is None and isinstance(event, TaskCreated):
            param = _largest_part(event)
        raise ApiError(
            413,
            f"The request is too large: as a task on the event log it is {exc.size} bytes,"
            f" more than the {exc.limit} bytes a NATS message may hold. {advice}",
            param=param,
            code="request_too_large",
        ) from None


def _largest_part(task: TaskCreated) -> str:
    """The field that made a task too large: its prompt, messages, or the tools' schemas
    (which count too)."""
    if task.kind == "completion":
        return "prompt"
    tools = sum(len(t.model_dump_json()) for t in task.tools)
    return "tools" if tools > sum(len(m.content) for m in task.messages or []) else "messages"


def log_unavailable(exc: Exception) -> ApiError:
    why = f"the event log did not store the request ({type(exc).__name__}): NATS JetStream"
    return ApiError(503, f"{why} is unavailable; try again", code="log_unavailable")


def task_error(error: str) -> ApiError:
    # The runner rejects requests it cannot serve (prompt longer than the context...) with
    # a message meant for the caller: that is a bad request, anything else a server error.
    if error.startswith("invalid request"):
        return ApiError(400, error, code="invalid_request")
    return ApiError(500, f"the task failed: {error}", code="task_failed")


def failure_error(failed: TaskFailed) -> ApiError:
    """A task's failure as the client's error: a prompt too long for the context in the words
    of each dialect's own API (Claude Code compacts its conversation on Anthropic's)."""
    n, most = failed.prompt_tokens, failed.context_length
    if n is None or most is None:
        return task_error(failed.error)
    openai = (
        f"This model's maximum context length is {most} tokens. However, your messages resulted"
        f" in {n} tokens. Please reduce the length of the messages."
    )
    said: dict[Dialect, str] = {"anthropic": f"prompt is too long: {n} tokens > {most} maximum"}
    return ApiError(400, openai, "messages", "context_length_exceeded", said=said)


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event, compact JSON; with ``event``, a named one (Anthropic's,
    Responses')."""
    data = f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
    return f"event: {event}\n{data}" if event else data


def ndjson(payload: dict[str, Any]) -> str:
    """One line of newline-delimited JSON (Ollama's streams)."""
    return json.dumps(payload, separators=(",", ":")) + "\n"

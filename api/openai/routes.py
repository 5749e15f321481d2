"""The OpenAI-compatible endpoints: chat completions, completions, models."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse, StreamingResponse

from api import on_demand, projection
from api.anthropic.messages import model_entry, model_list
from api.context import ApiContext, context, require_key
from api.errors import ApiError, error_body
from api.images.loading import request_images
from api.model_list import Askable, askable
from api.openai.requests import ChatCompletionRequest, CompletionRequest, choice_params
from api.openai.shapes import (
    FINISH,
    Echo,
    Shape,
    chat_chunk,
    chat_completion,
    completion,
    completion_chunk,
)
from api.reply import Reply
from api.serving import Output, serve, sse
from api.task_stream import TaskStream
from api.thinking import shown
from events.catalogue import ChunkGenerated, TaskCreated, new_id
from events.records import Usage

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


@router.get("/models")
async def list_models(
    ctx: Ctx, anthropic_version: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    """Every model a client can ask for (api/model_list.py): those the cluster knows, the
    aliases clients may call them by and the catalogue's cards not added yet, in OpenAI's list
    shape, or in Anthropic's to its SDK (which always sends ``anthropic-version``)."""
    listed = await _listed(ctx)
    if anthropic_version is not None:
        return model_list([(entry.name, entry.created) for entry in listed])
    return {"object": "list", "data": [_model(entry) for entry in listed]}


@router.get("/models/{model}")
async def get_model(
    model: str, ctx: Ctx, anthropic_version: Annotated[str | None, Header()] = None
) -> dict[str, Any]:
    """One model or alias (the SDKs' ``models.retrieve``)."""
    for entry in await _listed(ctx):
        if entry.name == model:
            return model_entry(model, entry.created) if anthropic_version else _model(entry)
    raise ApiError(
        404, f"The model `{model}` does not exist", param="model", code="model_not_found"
    )


async def _listed(ctx: ApiContext) -> list[Askable]:
    state = await projection.cluster(ctx.engine)
    names = ctx.names_in(state)
    return askable(state, names, on_demand.downloadable(ctx.config))


def _model(entry: Askable) -> dict[str, Any]:
    """OpenAI's model object, with Shoal's fields: ``alias_of`` (an alias's model), ``loaded``
    (an instance serves it now; any other loads when asked for), ``added`` (the cluster has
    it; else a catalogue card, fetched when first asked for) and ``capabilities`` (Ollama's
    words, as llama.cpp's server lists them: ``vision`` for a model that reads images)."""
    alias = {} if entry.alias_of is None else {"alias_of": entry.alias_of}
    made = {"id": entry.name, "object": "model", "owned_by": "shoal", "created": entry.created}
    shoal = {"loaded": entry.loaded, "added": entry.added, "capabilities": entry.capabilities}
    return made | alias | shoal


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, ctx: Ctx
) -> JSONResponse | StreamingResponse:
    return await serve_chat(ctx, body)


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, ctx: Ctx) -> JSONResponse | StreamingResponse:
    return await serve_completion(ctx, body)


async def serve_chat(
    ctx: ApiContext, body: ChatCompletionRequest
) -> JSONResponse | StreamingResponse:
    model_id = await ctx.resolve_model(body.model)
    images = await request_images(ctx, model_id, body.image_inputs())
    task = TaskCreated(
        task_id=new_id(),
        model_id=model_id,
        origin=ctx.origin,
        kind="chat",
        messages=body.chat_messages(images),
        params=body.sampling(),
        user=body.user,
        **body.task_fields(),
    )
    shape = Shape(f"chatcmpl-{task.task_id}", body.model or model_id, chat=True)
    out = _ChatOut(shape, bool(body.logprobs), body.include_usage, shown(task.thinking))
    return await serve(ctx, _choices(task, body.n), body.stream, out, images)


async def serve_completion(
    ctx: ApiContext, body: CompletionRequest
) -> JSONResponse | StreamingResponse:
    model_id = await ctx.resolve_model(body.model)
    task = TaskCreated(
        task_id=new_id(),
        model_id=model_id,
        origin=ctx.origin,
        kind="completion",
        prompt=body.text(),
        prompt_token_ids=body.token_ids(),
        params=body.sampling(),
        user=body.user,
        **body.task_fields(),
    )
    shape = Shape(f"cmpl-{task.task_id}", body.model or model_id, chat=False)
    out = _CompletionOut(
        shape, body.logprobs is not None, body.echo, body.text(), body.include_usage
    )
    return await serve(ctx, _choices(task, body.n), body.stream, out)


def _choices(task: TaskCreated, n: int) -> list[TaskCreated]:
    """A request for ``n`` choices is ``n`` tasks, each with its own seed (``choice_params``);
    only the first scores the prompt, which the choices share."""
    return [task] + [
        task.model_copy(
            update={
                "task_id": new_id(),
                "event_id": new_id(),
                "echo": False,
                "params": choice_params(task.params, i),
            }
        )
        for i in range(1, n)
    ]


class _OpenAiOut(Output):
    """OpenAI's stream ends: the usage chunk when asked for, an error event, ``[DONE]``."""

    def __init__(self, shape: Shape, include_usage: bool) -> None:
        self.shape = shape
        self._include_usage = include_usage

    def closing(self, replies: list[Reply], usages: list[Usage]) -> str:
        usage = sse(self.shape.usage_chunk(usages)) if self._include_usage else ""
        return usage + _DONE

    def failure(self, err: ApiError) -> str:
        return sse(error_body(err.status, err.message, code=err.code)) + _DONE


class _ChatOut(_OpenAiOut):
    def __init__(
        self, shape: Shape, logprobs: bool, include_usage: bool, reasoning: bool = True
    ) -> None:
        super().__init__(shape, include_usage)
        self._logprobs = logprobs
        self._reasoning = reasoning

    def opening(self, ts: TaskStream, index: int) -> str:
        role = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse(self.shape.head("chat.completion.chunk") | {"choices": [role]})

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        # One event per chunk, each as the client would get it alone.
        made = (
            chat_chunk(self.shape, index, [c], False, self._logprobs, self._reasoning)
            for c in group
        )
        return "".join(sse(m) for m in made if m is not None)

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        return chat_completion(self.shape, replies, usages, self._logprobs, self._reasoning)


class _CompletionOut(_OpenAiOut):
    def __init__(
        self, shape: Shape, logprobs: bool, echo: bool, prompt: str | None, include_usage: bool
    ) -> None:
        super().__init__(shape, include_usage)
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
        return sse(completion_chunk(self.shape, index, echo.text, entries, 0, None))

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        out = []
        for c in group:
            if not (c.text or c.finish_reason or c.logprob):
                continue
            entries = ([c.logprob] if c.logprob else []) if self._logprobs else None
            finish = FINISH[c.finish_reason] if c.finish_reason else None
            offset = self._offsets.get(index, 0)
            out.append(sse(completion_chunk(self.shape, index, c.text, entries, offset, finish)))
            self._offsets[index] = offset + (len(c.logprob.token) if c.logprob else len(c.text))
        return "".join(out)

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        echo = self._echoed(first)
        return completion(self.shape, replies, usages, self._logprobs, echo, self._start(echo))


_DONE = "data: [DONE]\n\n"

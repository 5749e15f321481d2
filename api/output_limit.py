"""The output limit of a request that sets none: the model's ``max_tokens`` in
``--model-defaults``, else the API's ``--max-tokens`` (as llama-server's ``--n-predict``, Ollama's
``num_predict``); without either, the answer goes on until the model ends it or its context is
full. ``api/serving.py`` applies it to every dialect's tasks."""

from __future__ import annotations

from api.context import ApiContext
from events.catalogue import TaskCreated


async def default_max_tokens(ctx: ApiContext, task: TaskCreated) -> int | None:
    """The output limit ``task`` takes, its request having set none: its model's default
    (``--model-defaults``), else the API's (``--max-tokens``). None: the request set its own,
    or there is none (until the context is full)."""
    if task.params.max_tokens is not None:
        return None
    names = await ctx.model_names()
    own = ctx.config.model_defaults.for_model(task.model_id, names.resolve)
    if own is not None and own.max_tokens is not None:
        return own.max_tokens
    return ctx.config.max_tokens


def with_default_max_tokens(task: TaskCreated, limit: int | None) -> TaskCreated:
    """``task`` limited to ``limit`` tokens where its request set no limit. Its answer, cut
    there, ends as a cut one does (``length``), but for the Responses API's: completed, as
    llama-server's (api/responses/shapes.py)."""
    if limit is None or task.params.max_tokens is not None:
        return task
    params = task.params.model_copy(update={"max_tokens": limit})
    return task.model_copy(update={"params": params})

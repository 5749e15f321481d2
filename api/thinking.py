"""What every dialect asks of a thinking model, in Shoal's words: whether it thinks
(``TaskCreated.thinking``), how long (``TaskCreated.thinking_budget``: the runner ends a thinking
that spent it), the chat template's own variables, and whether the thinking is shown.

The runner always reads the thinking apart from the answer (``ChunkGenerated.reasoning``); a
dialect shows it in its own shape, unless the request turned the thinking off: then the
template's switch keeps the model from thinking where it has one, and the thinking a model
writes anyway is left out of the answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator

from events.catalogue import TaskCreated
from structured.reasoning import RESERVED_KWARGS


def _not_reserved(kwargs: dict[str, Any]) -> dict[str, Any]:
    if reserved := sorted(RESERVED_KWARGS.intersection(kwargs)):
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: Shoal sets it itself")
    return kwargs


# Variables for the model's chat template (``enable_thinking``...), as llama.cpp's server and
# vLLM take them; those the renderer sets itself are refused.
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_not_reserved)]


# What an effort lets a thinking model think, in tokens (``TaskCreated.thinking_budget``): OpenAI's
# ``reasoning_effort`` and the Responses API's ``reasoning.effort``, and Ollama's ``think``
# levels. "none" is no thinking at all.
EFFORT_BUDGETS: dict[str, int] = {
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
}
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def effort_thinks(effort: str | None) -> bool | None:
    """OpenAI's ``reasoning_effort`` (and the Responses API's ``reasoning.effort``): "none" turns
    the thinking off, any other effort on; None leaves the model's default."""
    if effort is None:
        return None
    return effort != "none"


def effort_budget(effort: str | None) -> int | None:
    """The thinking budget of an effort (``EFFORT_BUDGETS``); None: not sent, or "none"."""
    return EFFORT_BUDGETS.get(effort) if effort is not None else None


def with_default_budget(task: TaskCreated, budget: int | None) -> TaskCreated:
    """``task`` with the server's default thinking budget (``--reasoning-budget``; None:
    unbounded) where its request set none and did not turn the thinking off."""
    if budget is None or task.thinking_budget is not None or task.thinking is False:
        return task
    return task.model_copy(update={"thinking_budget": budget})


def shown(thinking: bool | None) -> bool:
    """Whether a task's thinking goes to the client: unless the request turned it off."""
    return thinking is not False

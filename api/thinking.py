"""What every dialect asks of a thinking model, in Shoal's words: whether it thinks
(``TaskCreated.thinking``), the chat template's own variables, and whether the thinking is shown.

The runner always reads the thinking apart from the answer (``ChunkGenerated.reasoning``); a
dialect shows it in its own shape, unless the request turned the thinking off: then the
template's switch keeps the model from thinking where it has one, and the thinking a model
writes anyway is left out of the answer.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from services.runner.structured.reasoning import RESERVED_KWARGS


def _not_reserved(kwargs: dict[str, Any]) -> dict[str, Any]:
    if reserved := sorted(RESERVED_KWARGS.intersection(kwargs)):
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: Shoal sets it itself")
    return kwargs


# Variables for the model's chat template (``enable_thinking``...), as llama.cpp's server and
# vLLM take them; those the renderer sets itself are refused.
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_not_reserved)]


def effort_thinks(effort: str | None) -> bool | None:
    """OpenAI's ``reasoning_effort`` (and the Responses API's ``reasoning.effort``): "none" turns
    the thinking off, any other effort on; None leaves the model's default. No effort sets a
    budget: the model thinks as long as it does."""
    if effort is None:
        return None
    return effort != "none"


def shown(thinking: bool | None) -> bool:
    """Whether a task's thinking goes to the client: unless the request turned it off."""
    return thinking is not False

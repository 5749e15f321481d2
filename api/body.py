"""What every dialect's request bodies are made of: the base of their models, and the JSON
schemas they carry (a structured output's, a tool's parameters), checked once for all."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from events.records import INT32_MAX
from structured import schema_problem


class RequestBody(BaseModel):
    """A request body, or a part of one. Fields a dialect's clients send that Shoal has no use
    for are let through unread (every SDK sends some); a field Shoal cannot honour is declared,
    and refused with a 400 by the translation that reads it."""

    model_config = ConfigDict(extra="ignore")


def _checked(schema: dict[str, Any]) -> dict[str, Any]:
    if (problem := schema_problem(schema)) is not None:
        raise ValueError(problem)
    return schema


def _object(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters are best effort: what the grammar cannot express is left out of it
    (``structured/schema.py``); what is refused is no schema at all."""
    if schema.get("type", "object") != "object":
        raise ValueError("a tool's parameters are a JSON schema of type 'object'")
    if (problem := schema_problem(schema, lenient=True)) is not None:
        raise ValueError(problem)
    return schema


# Token counts and context lengths: positive, and small enough for the projection's columns.
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
# A JSON schema the engine can constrain output to (schema_problem says why not).
JsonSchema = Annotated[dict[str, Any], AfterValidator(_checked)]
# A tool's parameters: a schema of an object, constrained as far as a grammar can.
ToolParameters = Annotated[dict[str, Any], AfterValidator(_object)]

"""Ollama's API, translated: the request bodies Ollama's clients send and how they become a
``TaskCreated`` (``replies.py`` writes what those clients read). Pure: bodies in, task fields
out.

As everywhere in Shoal, a field that changes the answer is honoured or refused with a 400 that
names it. Options that only tune the machine (threads, GPU layers, mmap, batch size) are
accepted and ignored: the instance was sized and placed when it was created.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from api.body import JsonSchema, RequestBody
from api.images.inputs import ImageInput, image_base64
from api.images.placed import NO_IMAGES, Images
from api.openai.requests import MAX_TOOLS, ToolDef
from api.thinking import effort_budget, effort_thinks
from events.records import (
    INT32_MAX,
    ChatMessage,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
)
from services.planner.on_demand import parse_keep_alive

# What GET /api/version answers. Clients gate features on Ollama's version: tools came with
# 0.3, JSON-schema `format` with 0.5, `think` with 0.9 (Open WebUI and the `ollama` client
# check it). 0.9.0 is the newest whose features Shoal serves, so a client that checks sends
# what works.
VERSION = "0.9.0"

# Ollama's own sampling defaults (its API reference), for a request that sets none: the same
# request gives the same kind of answer as from Ollama. (Its repeat_penalty 1.1 over the last
# 64 tokens, prompt included, is not reproducible: Shoal's penalty covers generated tokens.)
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9
DEFAULT_TOP_K = 40
MAX_STOPS = 16


# --- options --------------------------------------------------------------------------------

# Options that tune the machine, not the answer: accepted, ignored. num_ctx too: the context is
# the instance's (set when it is created), and a longer prompt is refused, never cut.
IGNORED_OPTIONS = frozenset(
    {
        "numa",
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",
        "penalize_newline",  # Ollama itself no longer reads it
    }
)


class Options(BaseModel):
    """Ollama's ``options``: sampling is honoured; options Shoal cannot honour are refused
    unless set to the value that does nothing; an option nobody knows is refused too (it would
    most likely be a sampling setting gone unheard)."""

    model_config = ConfigDict(extra="allow")

    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    num_predict: Annotated[int, Field(ge=-2, le=INT32_MAX)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # Refused unless they have no effect (see _honourable).
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None

    @model_validator(mode="after")
    def _honourable(self) -> Options:
        for key in self.model_extra or {}:
            if key not in IGNORED_OPTIONS:
                raise ValueError(f"{key!r} is not an option Shoal knows")
        if self.num_predict == 0:
            raise ValueError("num_predict 0 generates nothing: send -1 (no limit) or more")
        if self.mirostat:
            raise ValueError(
                "mirostat is not supported: Shoal samples with temperature,"
                " top_k, top_p and min_p (send mirostat 0)"
            )
        if self.tfs_z not in (None, 1.0):
            raise ValueError("tfs_z (tail-free sampling) is not supported (send 1)")
        if self.typical_p not in (None, 1.0):
            raise ValueError("typical_p (locally typical sampling) is not supported (send 1)")
        if self.repeat_last_n not in (None, 0) and self.repeat_penalty not in (None, 1.0):
            raise ValueError(
                "repeat_last_n is not supported: Shoal's repeat_penalty"
                " covers every generated token (leave repeat_last_n out)"
            )
        return self

    def sampling(self) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # -1 is no limit, -2 "until the context is full": both are the context's limit here.
        limit = self.num_predict if self.num_predict is not None and self.num_predict > 0 else None
        return SamplingParams(
            max_tokens=limit,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
            top_k=DEFAULT_TOP_K if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            # A negative seed is llama.cpp's (and Ollama's) "random".
            seed=self.seed if self.seed is not None and self.seed >= 0 else None,
            stop=[s for s in stops if s],
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repeat_penalty=self.repeat_penalty or 1.0,
        )


# --- chat -----------------------------------------------------------------------------------


class FunctionCall(RequestBody):
    name: Annotated[str, Field(min_length=1)]
    # An object in Ollama's API; JSON text is taken too (what an OpenAI history holds).
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCallIn(RequestBody):
    function: FunctionCall
    # Not Ollama's, but what Open WebUI carries over from an OpenAI history.
    id: str | None = None


class Message(RequestBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None  # as a call's id above
    # An earlier answer's thinking: the chat template keeps or drops it.
    thinking: str | None = None

    # Its images, as its validation read them.
    _images: list[ImageInput] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _readable(self) -> Message:
        if self.images and self.role != "user":
            raise ValueError("only a user message may hold images")
        self._images = _read(self.images)
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    def image_inputs(self, where: str) -> list[ImageInput]:
        """Its images (``where``: the field of the request that holds them)."""
        return [replace(image, where=f"{where}.{j}") for j, image in enumerate(self._images)]


def _read(images: list[str] | None) -> list[ImageInput]:
    """Ollama's images: base64 strings (a data URL is taken too)."""
    read = []
    for j, data in enumerate(images or []):
        try:
            read.append(image_base64(data))
        except ValueError as exc:
            raise ValueError(f"images[{j}]: {exc}") from None
    return read


def _arguments_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def chat_messages(messages: list[Message], images: Images = NO_IMAGES) -> list[ChatMessage]:
    """The history as Shoal's messages. Ollama's calls have no ids and a tool's result names
    its tool: each call gets an id (its own, or its place in the history), and each result the
    id of the call it names (``tool_call_id``), else of the oldest unanswered call of its tool,
    else of the oldest unanswered one. A user's images (``images``: the request's, read) come
    before its text, as Ollama puts them."""
    out: list[ChatMessage] = []
    unanswered: list[ToolCall] = []
    for i, m in enumerate(messages):
        content = m.content or ""
        if m.role == "assistant":
            calls = [
                ToolCall(
                    id=c.id or f"call_{i}_{j}",
                    name=c.function.name,
                    arguments=_arguments_text(c.function.arguments),
                )
                for j, c in enumerate(m.tool_calls or [])
            ]
            unanswered = list(calls)
            out.append(
                ChatMessage(
                    role="assistant",
                    content=content,
                    tool_calls=calls,
                    reasoning=m.thinking or None,
                )
            )
        elif m.role == "tool":
            by_id = [c for c in unanswered if c.id == m.tool_call_id]
            by_name = [c for c in unanswered if c.name == m.tool_name]
            call = next(iter(by_id or by_name or unanswered), None)
            if call is not None:
                unanswered.remove(call)
            out.append(
                ChatMessage(
                    role="tool",
                    content=content,
                    name=m.tool_name or (call.name if call else None),
                    tool_call_id=call.id if call else None,
                )
            )
        else:
            placed = [images.at(image, 0) for image in m._images]
            out.append(ChatMessage(role=m.role, content=content, images=placed))
    return out


Format = Literal["", "json"] | JsonSchema


def response_format(fmt: Format | None) -> ResponseFormat | None:
    if fmt == "json":
        return ResponseFormat(type="json_object")
    if isinstance(fmt, dict):
        return ResponseFormat(type="json_schema", name="response", json_schema=fmt)
    return None


def keep_alive_s(keep_alive: float | str | None) -> float | None:
    """Ollama's ``keep_alive`` in seconds (None: not sent); ``ValueError`` naming it."""
    if keep_alive is None:
        return None
    try:
        return parse_keep_alive(keep_alive)
    except ValueError as exc:
        raise ValueError(f"keep_alive: {exc}") from None


class _Generation(RequestBody):
    # None: the cluster's default model (api/model_names.py).
    model: Annotated[str, Field(min_length=1)] | None = None
    format: Format | None = None
    options: Options | None = None
    # Ollama streams unless told not to.
    stream: bool = True
    # How long the model stays loaded once idle: seconds, a duration ('5m'), 0 (unload after
    # the request) or negative (keep); it sets the keep-alive of instances loaded on demand
    # (pinned ones stay: services/planner/on_demand.py).
    keep_alive: float | str | None = None
    # true, false, or a level ("low", "medium", "high": thinking, as long as the level's
    # budget, api/thinking.py's table).
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _generation(self) -> _Generation:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self.keep_alive_s()  # a bad one is a 400 now
        return self

    def keep_alive_s(self) -> float | None:
        """``keep_alive`` in seconds (None: not sent)."""
        return keep_alive_s(self.keep_alive)

    def sampling(self) -> SamplingParams:
        return (self.options or Options()).sampling()

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def thinking(self) -> bool | None:
        """``think``: true or false, a level is true; not sent, the model's default (its
        thinking shown apart, as Ollama does)."""
        return self.think if isinstance(self.think, bool) else effort_thinks(self.think)

    @property
    def thinking_budget(self) -> int | None:
        """A level's budget (``think: "low"``...); true, false or not sent: none."""
        return effort_budget(self.think) if isinstance(self.think, str) else None


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or [] if t.function is not None]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        return self

    def image_inputs(self) -> list[ImageInput]:
        """The images the messages send, in order."""
        return [
            image
            for i, m in enumerate(self.messages)
            for image in m.image_inputs(f"messages.{i}.images")
        ]

    def task_fields(self, images: Images = NO_IMAGES) -> dict[str, Any]:
        """What the task carries besides its model and ids (``images``: the request's, read).
        Ollama has no tool_choice: with tools, the model may call them."""
        tools = [
            Tool(
                name=t.function.name,
                description=t.function.description,
                parameters=t.function.parameters or {"type": "object", "properties": {}},
            )
            for t in self.tools or []
            if t.function is not None
        ]
        return {
            "kind": "chat",
            "messages": chat_messages(self.messages, images),
            "params": self.sampling(),
            "tools": tools,
            "tool_choice": ToolChoice(mode="auto" if tools else "none"),
            "response_format": response_format(self.format),
            "logprobs": self.logprob_count(),
            "thinking": self.thinking,
            "thinking_budget": self.thinking_budget,
            "keep_alive_s": self.keep_alive_s(),
        }


class GenerateRequest(_Generation):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    # Refused when set (see _supported); accepted when empty, as the client sends them.
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None
    # Its images, as its validation read them.
    _images: list[ImageInput] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _supported(self) -> GenerateRequest:
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.template:
            raise ValueError(
                "template is not supported: Shoal applies the model's own chat"
                " template (or none, with raw: true)"
            )
        if self.context:
            raise ValueError(
                "context is not supported: Shoal keeps no conversation between"
                " requests; send the conversation to /api/chat"
            )
        if self.images and self.raw:
            raise ValueError(
                "images with raw: true are not supported: a raw prompt has no place for them"
                " (send them without raw, or to /api/chat)"
            )
        self._images = _read(self.images)
        if self.raw and self.system:
            raise ValueError(
                "system with raw: true: a raw prompt is given to the model as it"
                " is; put the system text into the prompt"
            )
        if self.raw and self.format:
            raise ValueError(
                "format with raw: true is not supported: send the prompt without"
                " raw to have the reply constrained"
            )
        return self

    def image_inputs(self) -> list[ImageInput]:
        """The images sent with the prompt, in order."""
        return [replace(image, where=f"images.{j}") for j, image in enumerate(self._images)]

    def task_fields(self, images: Images = NO_IMAGES) -> dict[str, Any]:
        """A raw prompt is a completion; otherwise the prompt (and system) are a chat, which
        is what Ollama does: it puts them through the model's template (its images, ``images``
        read, before the prompt's text)."""
        fields: dict[str, Any] = {
            "params": self.sampling(),
            "logprobs": self.logprob_count(),
            "thinking": self.thinking,
            "thinking_budget": self.thinking_budget,
            "keep_alive_s": self.keep_alive_s(),
        }
        if self.raw:
            return fields | {"kind": "completion", "prompt": self.prompt or ""}
        system = [ChatMessage(role="system", content=self.system)] if self.system else []
        placed = [images.at(image, 0) for image in self._images]
        user = ChatMessage(role="user", content=self.prompt or "", images=placed)
        return fields | {
            "kind": "chat",
            "messages": [*system, user],
            "response_format": response_format(self.format),
        }


# --- other requests -------------------------------------------------------------------------


class NamedRequest(RequestBody):
    """``/api/show``, ``/api/delete``, ``/api/pull``: a model, as ``model`` or the older
    ``name``."""

    model: str | None = None
    name: str | None = None
    stream: bool = True  # /api/pull streams unless told not to
    insecure: bool | None = None  # a registry's TLS: nothing Shoal downloads from here
    verbose: bool | None = None  # /api/show's tokenizer arrays: Shoal has none to show

    @model_validator(mode="after")
    def _named(self) -> NamedRequest:
        if not (self.model or self.name):
            raise ValueError("model: the request names no model")
        return self

    @property
    def given(self) -> str:
        return self.model or self.name or ""


class EmbedRequest(RequestBody):
    model: Annotated[str, Field(min_length=1)] | None = None
    input: str | list[str] = ""
    # Ollama cuts an input longer than the context unless told not to; Shoal never cuts one:
    # it is a 400 either way (what Ollama answers with truncate: false).
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    options: Options | None = None  # sampling means nothing here; machine options are ignored
    keep_alive: float | str | None = None  # as _Generation's

    @model_validator(mode="after")
    def _keep_alive(self) -> EmbedRequest:
        keep_alive_s(self.keep_alive)  # a bad one is a 400 now
        return self

    def inputs(self) -> list[str]:
        """The texts; none (an empty input) is Ollama's way to load the model."""
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return list(self.input)


class EmbeddingsRequest(RequestBody):
    """The older ``/api/embeddings``: one prompt, one vector."""

    model: Annotated[str, Field(min_length=1)] | None = None
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None  # as _Generation's

    @model_validator(mode="after")
    def _keep_alive(self) -> EmbeddingsRequest:
        keep_alive_s(self.keep_alive)  # a bad one is a 400 now
        return self

"""Anthropic's Messages API: the request bodies Shoal accepts, how they become a
``TaskCreated``, and the responses made from a task's chunks (whole, or as Anthropic's named
stream events; the message's own shape is ``shapes.py``). Pure: bodies in, task fields out;
chunks in, dicts and events out.

Every field that changes the answer is honoured or refused with a 400 that names it (MCP
servers, containers, a prefilled assistant turn, documents, images for a model that reads text
only, Anthropic-defined client tools); fields that do not (``metadata``, ``cache_control``,
``service_tier``, ``output_config.effort`` where the model does not think, ``context_management``'s
``clear_thinking`` edit...) are accepted, as are fields Anthropic does not define. What Claude
Code sends is accepted as it is (``tests/clients/fixtures``):

- server tools (``web_search_...``, ``web_fetch_...``, ``code_execution_...``,
  ``tool_search_tool_...``) are left out, as a model that cannot call them would leave them,
  unless ``tool_choice`` names one (then a 400: Shoal runs none);
- a deferred tool (``defer_loading``) is not offered until the conversation has called it or
  ``tool_choice`` names it: the client's tool search loads it;
- ``output_config.effort`` is the thinking's budget when the model thinks and the request set
  none (``api/thinking.py``'s, ``max`` unbounded);
- a tool's ``input_schema`` is best effort (``api/body.py``).

Extended thinking: with ``thinking: {"type": "enabled"}`` a thinking model's thinking comes as
a ``thinking`` block before the text (``thinking_delta`` events, then a ``signature_delta``,
streamed), for at most ``budget_tokens`` (then the runner ends the thinking itself and the
answer follows); without it the model is asked not to think (its template's switch) and what it
thinks anyway is left out, as Anthropic's models do not think unless asked. An earlier turn's
``thinking`` block goes to the chat template as the turn's thinking, which keeps or drops it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from api.anthropic.content import Block, Message, at_field, block_problem, images_in, text_of
from api.anthropic.shapes import (
    message,
    signature,
    stop_reason,
    stop_sequence,
    usage,
    whole_message,
)
from api.body import JsonSchema, RequestBody, ToolParameters
from api.errors import ApiError, anthropic_error_body
from api.images.inputs import ImageInput
from api.images.placed import NO_IMAGES, Images
from api.reply import Reply
from api.serving import Output, sse
from api.task_stream import TaskStream
from api.thinking import effort_budget
from events.catalogue import ChunkGenerated, TaskCreated, new_id
from events.records import (
    INT32_MAX,
    ChatMessage,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolChoice,
    Usage,
)

MAX_TOOLS = 128
MAX_STOPS = 64
# Anthropic's rule for tool names.
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]


# --- requests -------------------------------------------------------------------------------


# Anthropic's server tools, by their type's prefix: run by Anthropic, which Shoal is not.
SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


class ToolDef(RequestBody):
    """A client tool, or a server tool (left out: see the module's docstring). Anthropic's
    schema-less client tools (``bash_...``, ``text_editor_...``, ``computer_...``,
    ``memory_...``) are refused: their schema is Anthropic's, which Shoal's models do not
    know."""

    type: str | None = None
    name: ToolName
    description: str = ""
    input_schema: ToolParameters | None = None
    input_examples: list[Any] | None = None
    defer_loading: bool | None = None
    strict: bool | None = None  # every call is constrained to the schema anyway

    @model_validator(mode="after")
    def _client_tool(self) -> ToolDef:
        if self.server:
            return self
        if self.type not in (None, "custom"):
            raise ValueError(
                f"tools of type {self.type!r} are not supported: its schema is Anthropic's,"
                " send a client tool (name, input_schema) instead"
            )
        if self.input_schema is None:
            raise ValueError(f"the tool {self.name!r} needs its input_schema")
        if self.input_examples:
            raise ValueError("input_examples is not supported")
        return self

    @property
    def server(self) -> bool:
        """One of Anthropic's server tools."""
        return self.type is not None and self.type.startswith(SERVER_TOOLS)

    def event(self) -> Tool:
        assert self.input_schema is not None
        return Tool(name=self.name, description=self.description, parameters=self.input_schema)


class ToolChoiceIn(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceIn:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's name")
        return self


class Thinking(RequestBody):
    type: str
    # The thinking's budget: the runner ends a thinking that spent it (TaskCreated's
    # thinking_budget). Adaptive thinking has none (the model's own, output_config.effort's, or
    # the server's default).
    budget_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    # "omitted": thinking blocks come with their signature and no text (Claude Code asks so);
    # any other ("summarized", Claude Code's "updates"): the thinking as the model wrote it.
    display: str | None = None

    @model_validator(mode="after")
    def _known(self) -> Thinking:
        if self.type not in ("enabled", "adaptive", "disabled"):
            raise ValueError(
                f"thinking of type {self.type!r} is not supported: send 'enabled',"
                " 'adaptive' or 'disabled'"
            )
        return self

    @property
    def shown(self) -> bool:
        """Whether the thinking's text goes to the client."""
        return self.display != "omitted"

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"

    @property
    def budget(self) -> int | None:
        """The thinking budget: ``budget_tokens`` of enabled thinking; adaptive thinking is the
        model's own (none, or the server's default)."""
        return self.budget_tokens if self.type == "enabled" else None


class JsonOutputFormat(RequestBody):
    type: str
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")

    @model_validator(mode="after")
    def _json_schema(self) -> JsonOutputFormat:
        if self.type != "json_schema":
            raise ValueError(
                f"an output format of type {self.type!r} is not supported: send 'json_schema'"
            )
        return self


# Anthropic's efforts; each bounds the thinking as OpenAI's of the same name ("max": no bound).
AnthropicEffort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(RequestBody):
    format: JsonOutputFormat | None = None
    # How hard the model works: Shoal's models think for the effort's budget (a model that
    # does not think answers as it would).
    effort: AnthropicEffort | None = None

    @property
    def budget(self) -> int | None:
        return effort_budget(self.effort) if self.effort != "max" else None


class ContextEdit(RequestBody):
    """One of ``context_management``'s edits: ``clear_thinking_...`` is accepted as the no-op
    it is here (a chat template keeps or drops earlier thinking itself; Shoal keeps no
    context between requests to clear); another edit would change the prompt, and is
    refused."""

    type: str

    @field_validator("type")
    @classmethod
    def _no_op(cls, kind: str) -> str:
        if not kind.startswith("clear_thinking_"):
            raise ValueError(
                f"the context edit {kind!r} is not supported: Shoal sends the conversation"
                " as it is (only clear_thinking, a no-op here, is taken)"
            )
        return kind


class ContextManagement(RequestBody):
    edits: list[ContextEdit] = Field(default_factory=list)


class Metadata(RequestBody):
    user_id: Annotated[str, Field(max_length=255)] | None = None


class MessagesBody(RequestBody):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the conversation as the
    model reads it."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[Block] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceIn | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    # Answer-changing fields Shoal cannot honour (see _consistent).
    container: Any = None
    mcp_servers: list[Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MessagesBody:
        if self.container is not None:
            raise ValueError("container is not supported: Shoal runs no code execution")
        if self.mcp_servers:
            raise ValueError("mcp_servers is not supported: Shoal connects to no MCP server")
        for i, block in enumerate(self.system if isinstance(self.system, list) else []):
            if (problem := block_problem(block, ("text",))) is not None:
                raise ValueError(at_field(f"system[{i}]", problem))
        if self.messages[-1].role == "assistant":
            raise ValueError(
                "the last message is the assistant's (a prefill, to be continued):"
                " not supported, end with a user message"
            )
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.offered():
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(
                f"tool_choice names the tool {choice.name!r}, which is not among the tools"
            )
        server = [t for t in self.tools or [] if t.server]
        if choice is not None and choice.type == "tool" and choice.name in {t.name for t in server}:
            raise ValueError(
                f"tool_choice names the server tool {choice.name!r}: Shoal runs no server tools"
            )
        return self

    def offered(self) -> list[ToolDef]:
        """The tools the model is offered: the client's, but for deferred ones the
        conversation has not called yet (unless tool_choice names them)."""
        called = {
            b.name
            for m in self.messages
            if m.role == "assistant" and isinstance(m.content, list)
            for b in m.content
            if b.type == "tool_use"
        }
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            called.add(self.tool_choice.name or "")
        return [
            t
            for t in self.tools or []
            if not t.server and (not t.defer_loading or t.name in called)
        ]

    def image_inputs(self) -> list[ImageInput]:
        """The images the messages send (tool results' included), in order."""
        return [
            image
            for i, m in enumerate(self.messages)
            for image in images_in(m.content, f"messages.{i}.content")
        ]

    def chat_messages(self, images: Images = NO_IMAGES) -> list[ChatMessage]:
        """The system prompt and the messages, with ``images`` (``image_inputs``, read) in
        their places."""
        system = text_of(self.system)
        head = [ChatMessage(role="system", content=system)] if system else []
        return head + [c for m in self.messages for c in m.chat_messages(images)]

    def response_format(self) -> ResponseFormat | None:
        fmt = self.output_format or (self.output_config.format if self.output_config else None)
        if fmt is None:
            return None
        return ResponseFormat(type="json_schema", name="output", json_schema=fmt.schema_)

    def task_fields(self, images: Images = NO_IMAGES) -> dict[str, Any]:
        """What the task carries besides its sampling (``images``: the request's, read)."""
        tools = [t.event() for t in self.offered()]
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            tool_choice = ToolChoice(mode="auto" if tools else "none")
        elif choice.type == "any":
            tool_choice = ToolChoice(mode="required")
        elif choice.type == "tool":
            tool_choice = ToolChoice(mode="function", name=choice.name)
        else:
            tool_choice = ToolChoice(mode="none")
        return {
            "messages": self.chat_messages(images),
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": not (choice and choice.disable_parallel_tool_use),
            "response_format": self.response_format(),
            "user": self.metadata.user_id if self.metadata else None,
            "thinking": self.thinks,
            "thinking_budget": self.thinking_budget,
        }

    @property
    def thinking_budget(self) -> int | None:
        """``budget_tokens``, else the effort's budget when the model is asked to think."""
        if self.thinking is None or not self.thinking.enabled:
            return None
        if self.thinking.budget is not None:
            return self.thinking.budget
        return self.output_config.budget if self.output_config is not None else None

    @property
    def thinking_shown(self) -> bool:
        """Whether the thinking's text goes to the client (``display: omitted``: not)."""
        return self.thinking is None or self.thinking.shown

    @property
    def thinks(self) -> bool:
        """Anthropic's models think only when asked."""
        return self.thinking is not None and self.thinking.enabled


class MessagesRequest(MessagesBody):
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=[s for s in self.stop_sequences or [] if s],
        )


def task_for(
    body: MessagesBody,
    model_id: str,
    origin: str,
    params: SamplingParams,
    images: Images = NO_IMAGES,
) -> TaskCreated:
    return TaskCreated(
        task_id=new_id(),
        model_id=model_id,
        origin=origin,
        kind="chat",
        params=params,
        **body.task_fields(images),
    )


# --- responses ------------------------------------------------------------------------------


class MessagesOut(Output):
    """A message, whole or streamed. Streamed, content blocks are opened as their content
    comes: the thinking block when the first thinking does (``thinking``: when asked), the
    text block when the first text does, a ``tool_use`` block with each call's first piece (the
    arguments then arrive as ``input_json_delta``s); a block is stopped when the next one
    starts, so indices count blocks in their order (thinking, text, calls, as a model writes
    them); a thinking block gets its ``signature_delta`` before it stops. ``message_start`` is
    sent with the first chunk's events, and made from that chunk, which says the prompt's
    size: its ``input_tokens`` are the final usage's (0 from a runner that does not say); the
    final ``message_delta`` carries both counts."""

    def __init__(
        self, msg_id: str, model: str, thinking: bool = False, thinking_shown: bool = True
    ) -> None:
        self._id = msg_id
        self._model = model
        self._thinking = thinking
        self._shown = thinking_shown  # the thinking's text, or (display: omitted) not
        self._thought = ""  # the thinking block's text, for its signature
        self._open: str | int | None = None  # "thinking", "text", a call's index, or none yet
        self._blocks = 0  # blocks started so far
        self._calls: dict[int, int] = {}  # a call's index -> its block's index
        # The stream opened, its message_start not sent yet: it goes with the first events
        # (as an opening would), made once the first chunk said the prompt's size.
        self._starting = False
        self._prompt: Usage | None = None

    def opening(self, ts: TaskStream, index: int) -> str:
        self._starting = True
        return ""

    def _started(self, events: str) -> str:
        """``events``, after ``message_start`` (and a ping) the first time."""
        if not self._starting:
            return events
        self._starting = False
        start = message(self._id, self._model, [], None, None, self._prompt)
        opened = sse({"type": "message_start", "message": start}, "message_start")
        return opened + sse({"type": "ping"}, "ping") + events

    def _start(self, key: str | int, block: dict[str, Any]) -> str:
        out = self._stop()
        self._open = key
        self._blocks += 1
        index = self._blocks - 1
        event = {"type": "content_block_start", "index": index, "content_block": block}
        return out + sse(event, "content_block_start")

    def _stop(self) -> str:
        if self._open is None:
            return ""
        out = ""
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": signature(self._thought)}
            out = self._delta(self._blocks - 1, delta)
        self._open = None
        event = {"type": "content_block_stop", "index": self._blocks - 1}
        return out + sse(event, "content_block_stop")

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        event = {"type": "content_block_delta", "index": index, "delta": delta}
        return sse(event, "content_block_delta")

    def events(self, index: int, group: list[ChunkGenerated]) -> str:
        out = []
        for c in group:
            if c.prompt_tokens is not None and self._prompt is None:
                cached = c.cached_tokens or 0
                self._prompt = Usage(
                    prompt_tokens=c.prompt_tokens, completion_tokens=0, cached_tokens=cached
                )
            if c.reasoning and self._thinking:
                if self._open != "thinking":
                    opened = {"type": "thinking", "thinking": "", "signature": ""}
                    out.append(self._start("thinking", opened))
                self._thought += c.reasoning
                if self._shown:
                    thought = {"type": "thinking_delta", "thinking": c.reasoning}
                    out.append(self._delta(self._blocks - 1, thought))
            if c.text:
                if self._open != "text":
                    out.append(self._start("text", {"type": "text", "text": ""}))
                out.append(self._delta(self._blocks - 1, {"type": "text_delta", "text": c.text}))
            for d in c.tool_calls:
                if d.index not in self._calls:
                    block = {
                        "type": "tool_use",
                        "id": d.id or "",
                        "name": d.name or "",
                        "input": {},
                    }
                    out.append(self._start(d.index, block))
                    self._calls[d.index] = self._blocks - 1
                if d.arguments:
                    delta = {"type": "input_json_delta", "partial_json": d.arguments}
                    out.append(self._delta(self._calls[d.index], delta))
        return self._started("".join(out)) if out else ""

    def closing(self, replies: list[Reply], usages: list[Usage]) -> str:
        reply = replies[0]
        # A reply with no content still has its (empty) text block, as the whole one does.
        out = "" if self._blocks else self._start("text", {"type": "text", "text": ""})
        why = {"stop_reason": stop_reason(reply), "stop_sequence": stop_sequence(reply)}
        delta = {"type": "message_delta", "delta": why, "usage": usage(usages[0])}
        return self._started(
            out
            + self._stop()
            + sse(delta, "message_delta")
            + sse({"type": "message_stop"}, "message_stop")
        )

    def failure(self, err: ApiError) -> str:
        body = anthropic_error_body(err.status, err.message_in("anthropic"), err.code)
        return self._started(sse(body, "error"))

    def whole(self, replies: list[Reply], usages: list[Usage], first: TaskStream) -> Any:
        reply, thinking = replies[0], self._thinking
        return whole_message(self._id, self._model, reply, usages[0], thinking, self._shown)


# --- models ---------------------------------------------------------------------------------


def model_entry(name: str, created: int) -> dict[str, Any]:
    """One model as Anthropic's SDK reads it (``created`` in epoch seconds)."""
    when = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": name, "display_name": name, "created_at": when}


def model_list(models: list[tuple[str, int]]) -> dict[str, Any]:
    """``GET /v1/models`` as Anthropic's SDK reads it: (name, when added) each."""
    data = [model_entry(name, created) for name, created in models]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }

"""The OpenAI Responses API's request body (``POST /v1/responses``; its conversation part,
``ResponsesBody``, is also what ``POST /v1/responses/input_tokens`` counts) and how it becomes
a ``TaskCreated``: input items as chat messages, function tools, ``tool_choice``,
``text.format``. Pure: data in, data out (api/responses/routes.py reads and stores).

Every field that changes the answer is honoured or refused with a 400 that names it: tools
the client runs whose schema is OpenAI's (computer use, custom tools, local shell...),
reasoning summaries, ``include`` of what Shoal cannot produce, files and audio, item
references, prompt templates, conversations. Fields that do not change it (``metadata``,
``user``, ``service_tier``, ``prompt_cache_key``, ``client_metadata``...) are accepted. What
Codex sends is accepted as it is (``tests/clients/fixtures``):

- a ``namespace`` tool's functions are offered as functions of their own, and a call of one
  names its namespace (``"namespace"`` on the ``function_call`` item), as Codex needs to run it;
- hosted tools (``web_search``, ``file_search``, ``code_interpreter``, ``image_generation``,
  ``mcp``...) are left out, as a model that cannot call them would leave them, unless
  ``tool_choice`` names one (then a 400: Shoal runs none);
- ``include: ["reasoning.encrypted_content"]`` (sent with ``store: false``) is accepted, and
  answered with no encrypted content: the reasoning items hold the thinking in the clear, and
  come back as they are; the ``include``s of hosted tools' results have nothing to include.

``reasoning.effort`` "none" turns a thinking model's thinking off, any other effort on, with
that effort's budget (``api/thinking.py``); a ``reasoning`` input item is the next assistant
turn's thinking, which the chat template keeps or drops.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from api.body import Count, JsonSchema, RequestBody, ToolParameters
from api.errors import ApiError
from api.images.inputs import ImageInput
from api.images.placed import NO_IMAGES, Images
from api.openai.requests import MAX_TOOLS, FunctionName
from api.responses.items import InputItem, content_pieces, content_text
from api.thinking import Effort, effort_budget, effort_thinks
from events.catalogue import TaskCreated, new_id
from events.records import ChatMessage, ResponseFormat, SamplingParams, Tool, ToolCall, ToolChoice

# A response's id is its task's with this prefix: either names the other.
RESPONSE_PREFIX = "resp_"
MAX_METADATA = 16

_TOOL_CHOICES = ("auto", "none", "required")


# Tools OpenAI runs itself (and the Responses API's tool_choice may name by type).
HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "code_interpreter",
    "image_generation",
    "mcp",
    "tool_search",
)
# What include may ask for: what Shoal has none of to add (see the module's docstring).
INCLUDABLE = (
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
)


class FunctionTool(RequestBody):
    """A tool, in the Responses API's flat shape: a function, a ``namespace`` of functions,
    or a hosted tool (left out: see the module's docstring)."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: ToolParameters | None = None
    strict: bool | None = None  # every call is constrained to the schema anyway
    defer_loading: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's

    @model_validator(mode="after")
    def _function(self) -> FunctionTool:
        if self.hosted:
            return self
        if self.type not in ("function", "namespace"):
            raise ValueError(
                f"tools of type {self.type!r} are not supported: Shoal's models"
                " call only your functions (type 'function', or a 'namespace' of them)"
            )
        if self.name is None:
            raise ValueError(f"a {self.type} tool needs its name")
        if self.type == "namespace":
            if not self.tools:
                raise ValueError(f"the namespace {self.name!r} needs its tools")
            if any(t.type != "function" for t in self.tools):
                raise ValueError(f"the namespace {self.name!r} holds functions only")
        if self.defer_loading:
            raise ValueError("defer_loading is not supported: Shoal has no tool search")
        return self

    @property
    def hosted(self) -> bool:
        return self.type in HOSTED_TOOLS

    def functions(self) -> list[tuple[str | None, FunctionTool]]:
        """The functions this tool offers, each with its namespace (a hosted tool: none)."""
        if self.type == "namespace":
            return [(self.name, t) for t in self.tools or []]
        return [] if self.hosted else [(None, self)]

    def event(self) -> Tool:
        parameters = self.parameters or {"type": "object", "properties": {}}
        return Tool(name=self.name or "", description=self.description or "", parameters=parameters)

    def echoed(self) -> dict[str, Any]:
        if self.type == "namespace":
            tools = [t.echoed() for t in self.tools or []]
            return {
                "type": "namespace",
                "name": self.name,
                "description": self.description,
                "tools": tools,
            }
        if self.hosted:
            return self.model_dump(exclude_none=True)
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": True if self.strict is None else self.strict,
        }


class TextFormat(RequestBody):
    type: str
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _known(self) -> TextFormat:
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(
                f"text.format type {self.type!r} is not supported: send 'text',"
                " 'json_object' or 'json_schema'"
            )
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self

    def event(self) -> ResponseFormat | None:
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.type == "json_schema":
            return ResponseFormat(type="json_schema", name=self.name, json_schema=self.schema_)
        return None

    def echoed(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "name": self.name,
            "description": self.description,
            "schema": self.schema_,
            "strict": self.strict,
        }


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium(cls, verbosity: str | None) -> str | None:
        # Shoal's models write as they write: "medium", the default, is the only honest answer.
        if verbosity not in (None, "medium"):
            raise ValueError(
                f"verbosity {verbosity!r} is not supported: Shoal cannot make its"
                " models more or less verbose"
            )
        return verbosity


class ReasoningConfig(RequestBody):
    effort: Effort | None = None
    # A summary of the thinking: Shoal writes none ("auto" may choose so); the thinking itself
    # is the reasoning item's content.
    summary: str | None = None
    generate_summary: str | None = None  # the older name

    @model_validator(mode="after")
    def _no_summary(self) -> ReasoningConfig:
        for asked in (self.summary, self.generate_summary):
            if asked not in (None, "auto"):
                raise ValueError(
                    f"reasoning summary {asked!r} is not supported: Shoal does not summarise"
                    " a model's thinking (its reasoning items hold the thinking itself)"
                )
        return self


class ResponsesBody(RequestBody):
    """What ``POST /v1/responses`` and ``POST /v1/responses/input_tokens`` share: the
    conversation as the model reads it (the fields the SDK's ``input_tokens.count`` takes)."""

    model: Annotated[str, Field(min_length=1)] | None = None
    input: Annotated[list[InputItem], Field(max_length=10_000)] = Field(default_factory=list)
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    # Answer-changing, and not honoured (see _consistent).
    conversation: Any = None
    personality: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, value: Any) -> Any:
        """A string input is one user message."""
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: Any) -> Any:
        if choice is None or choice in _TOOL_CHOICES:
            return choice
        if isinstance(choice, dict) and choice.get("type") in HOSTED_TOOLS:
            raise ValueError(
                f"tool_choice {choice['type']!r} is not supported: Shoal runs no hosted tools"
            )
        if isinstance(choice, dict) and choice.get("type") == "function":
            if not isinstance(choice.get("name"), str) or not choice["name"]:
                raise ValueError("a function tool_choice needs the function's name")
            return {"type": "function", "name": choice["name"]}
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise ValueError(
            f"tool_choice {kind!r} is not supported: send 'auto', 'none',"
            " 'required' or {'type': 'function', 'name': ...}"
        )

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesBody:
        if self.conversation is not None:
            raise ValueError(
                "conversation is not supported: send the input itself, or previous_response_id"
            )
        if self.personality is not None:
            raise ValueError(
                "personality is not supported: Shoal's models have no style presets (say how to"
                " answer in the instructions)"
            )
        if not self.input and self.previous_response_id is None:
            raise ValueError("input is empty: send a string or a list of items")
        names = [f.name for _, f in self.functions()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if isinstance(choice, dict) and choice["name"] not in names:
            raise ValueError(
                f"tool_choice names the function {choice['name']!r}, which is not among the tools"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def image_inputs(self) -> list[ImageInput]:
        """The images the input sends, in order."""
        return [image for i, item in enumerate(self.input) for image in item.images(i)]

    def input_messages(self, images: Images = NO_IMAGES) -> list[ChatMessage]:
        """The input as messages, with ``images`` (``image_inputs``, read) in their places."""
        return chat_messages(self.input, images)

    def functions(self) -> list[tuple[str | None, FunctionTool]]:
        """The functions offered, a namespace's among them, each with its namespace."""
        return [f for t in self.tools or [] for f in t.functions()]

    def namespaces(self) -> dict[str, str]:
        """A namespace's function's name -> the namespace (for its calls' items)."""
        return {f.name or "": ns for ns, f in self.functions() if ns is not None}

    def task_fields(self) -> dict[str, Any]:
        """What the task carries besides its messages and sampling."""
        tools = [f.event() for _, f in self.functions()]
        choice = self.tool_choice
        if isinstance(choice, dict):
            tool_choice = ToolChoice(mode="function", name=choice["name"])
        else:
            tool_choice = ToolChoice(mode=choice or ("auto" if tools else "none"))
        fmt = self.text.format if self.text is not None else None
        return {
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "response_format": fmt.event() if fmt is not None else None,
            "thinking": self.thinking,
            "thinking_budget": effort_budget(self.reasoning.effort if self.reasoning else None),
        }

    @property
    def thinking(self) -> bool | None:
        return effort_thinks(self.reasoning.effort if self.reasoning else None)


class ResponsesRequest(ResponsesBody):
    """``POST /v1/responses``: the conversation, and how to answer and keep it."""

    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = None
    user: Annotated[str, Field(max_length=255)] | None = None
    # Answer-changing fields Shoal cannot honour (see _supported).
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    context_management: Any = None

    @field_validator("metadata")
    @classmethod
    def _few(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and len(metadata) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} metadata keys")
        return metadata

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        for asked in self.include or []:
            if asked not in INCLUDABLE:
                raise ValueError(
                    f"include {asked!r} is not supported: Shoal can include"
                    f" {', '.join(repr(i) for i in INCLUDABLE)} (of which it has none)"
                )
        if self.top_logprobs:
            raise ValueError(
                "top_logprobs is not supported by the Responses API here: use"
                " /v1/chat/completions with logprobs"
            )
        if self.max_tool_calls is not None:
            raise ValueError(
                "max_tool_calls is not supported: it limits built-in tools, which Shoal has none of"
            )
        for name in ("prompt", "context_management"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} is not supported: send the input itself, or previous_response_id"
                )
        if self.background and not self.keep:
            raise ValueError("background needs store: a background response is fetched later")
        if self.background and self.stream:
            raise ValueError(
                "background with stream is not supported: send one of them"
                " (GET /v1/responses/{id} fetches a background response)"
            )
        return self

    @property
    def keep(self) -> bool:
        """Whether the response is stored (``store`` defaults to true)."""
        return self.store is not False

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
        )

    def echoed(self) -> dict[str, Any]:
        """The request's settings as every response object repeats them."""
        fmt = self.text.format if self.text is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tools": [t.echoed() for t in self.tools or []],
            "tool_choice": self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {
                "format": fmt.echoed() if fmt is not None else {"type": "text"},
                "verbosity": "medium",
            },
            "truncation": self.truncation or "disabled",
            "reasoning": {
                "effort": self.reasoning.effort if self.reasoning else None,
                "summary": self.reasoning.summary if self.reasoning else None,
            },
            "metadata": self.metadata or {},
            "store": self.keep,
            "background": bool(self.background),
            "previous_response_id": self.previous_response_id,
            "user": self.user,
        }


# --- input items as chat messages --------------------------------------------------------

_ROLES: dict[str, Literal["system", "user", "assistant"]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def chat_messages(items: Iterable[InputItem], images: Images = NO_IMAGES) -> list[ChatMessage]:
    """Input items as the messages of a chat: a function call joins the assistant message it
    follows (calls the model made together are one message), its output is a tool message; a
    reasoning item is the thinking of the assistant turn that follows it. A user message's
    images are ``images``' records of them."""
    out: list[ChatMessage] = []
    thought = ""  # a reasoning item's, for the next assistant turn
    for item in items:
        if item.type == "reasoning":
            thought += item.text()
        elif item.type == "function_call":
            call = ToolCall(id=item.call_id or "", name=item.name or "", arguments=item.arguments)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and not thought:
                out[-1] = last.model_copy(update={"tool_calls": [*last.tool_calls, call]})
            else:
                out.append(
                    ChatMessage(role="assistant", tool_calls=[call], reasoning=thought or None)
                )
                thought = ""
        elif item.type == "function_call_output":
            out.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
        else:
            role = _ROLES[item.role or "user"]
            reasoning = (thought or None) if role == "assistant" else None
            content, placed = images.placed(content_pieces(item.content or ""))
            out.append(ChatMessage(role=role, content=content, images=placed, reasoning=reasoning))
            thought = ""  # a thinking no assistant turn followed is dropped
    return out


def require_answered_calls(conversation: list[ChatMessage]) -> None:
    """A function call's output answers a call of the conversation (OpenAI's 400 otherwise)."""
    calls = {c.id for m in conversation for c in m.tool_calls}
    for m in conversation:
        if m.role == "tool" and m.tool_call_id not in calls:
            raise ApiError(
                400,
                f"No tool call found for function call output with call_id {m.tool_call_id}.",
                param="input",
            )


def continued(
    previous: list[ChatMessage], body: ResponsesBody, images: Images = NO_IMAGES
) -> list[ChatMessage]:
    """The conversation of a request: the one it continues (its previous response's, output
    included), then its input (with ``images``, its images read); each function call output
    answers a call of it."""
    conversation = previous + body.input_messages(images)
    require_answered_calls(conversation)
    return conversation


def chat_task(
    body: ResponsesBody,
    conversation: list[ChatMessage],
    model_id: str,
    origin: str,
    params: SamplingParams,
    user: str | None = None,
) -> TaskCreated:
    """The chat task of a request: what a response is generated from, and what its input
    tokens are counted of (the same task, so the count is the response's ``input_tokens``)."""
    return TaskCreated(
        task_id=new_id(),
        model_id=model_id,
        origin=origin,
        kind="chat",
        messages=task_messages(body.instructions, conversation),
        params=params,
        user=user,
        **body.task_fields(),
    )


def task_messages(instructions: str | None, conversation: list[ChatMessage]) -> list[ChatMessage]:
    """The task's messages: the instructions first (they are this request's own: a response
    that continues this one does not inherit them), then the conversation."""
    head = [ChatMessage(role="system", content=instructions)] if instructions else []
    return head + conversation


def task_id_of(response_id: str) -> str | None:
    """The task of a response id (``resp_<task_id>``); None for an id Shoal never made."""
    if not response_id.startswith(RESPONSE_PREFIX):
        return None
    task_id = response_id.removeprefix(RESPONSE_PREFIX)
    ok = 0 < len(task_id) <= 100 and all(c.isalnum() or c in "-_" for c in task_id)
    return task_id if ok else None


def input_items(items: list[InputItem], task_id: str) -> list[dict[str, Any]]:
    """The request's items as ``GET /v1/responses/{id}/input_items`` lists them, each with an
    id (the client's, or one made from the task's)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        item_id = item.id or f"item_{task_id}_{i}"
        if item.type == "reasoning":
            content = [{"type": "reasoning_text", "text": item.text()}]
            out.append({"type": "reasoning", "id": item_id, "summary": [], "content": content})
        elif item.type == "function_call":
            out.append(
                {
                    "type": "function_call",
                    "id": item_id,
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        elif item.type == "function_call_output":
            out.append(
                {
                    "type": "function_call_output",
                    "id": item_id,
                    "call_id": item.call_id,
                    "output": item.text(),
                    "status": "completed",
                }
            )
        else:
            role = item.role or "user"
            kind = "output_text" if role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": item.text()}
            if kind == "output_text":
                part["annotations"] = []
            out.append(
                {
                    "type": "message",
                    "id": item_id,
                    "role": role,
                    "status": "completed",
                    "content": _listed_parts(item) if item.images(i) else [part],
                }
            )
    return out


def _listed_parts(item: InputItem) -> list[dict[str, Any]]:
    """A user message's text and images, as input items list them: an image by its URL, or
    (sent as data, which a stored item does not repeat) by none."""
    listed: list[dict[str, Any]] = []
    for part in item.content if isinstance(item.content, list) else []:
        if part._image is not None:
            url = part._image.url
            detail = part.detail if part.detail in ("low", "high", "auto") else "auto"
            listed.append(
                {"type": "input_image", "image_url": url, "file_id": None, "detail": detail}
            )
        else:
            listed.append({"type": "input_text", "text": content_text([part])})
    return listed

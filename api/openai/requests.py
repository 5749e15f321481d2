"""The OpenAI request bodies Shoal accepts, and how they become a ``TaskCreated``.

Every field that changes the answer is honoured or refused with a 400 that names it: a request
is never served as if a field it sent were not there. Fields that do not change the answer
(``metadata``, ``store``, ``service_tier``, ``user``...) are accepted; so are fields OpenAI does
not define, as other servers do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from api.body import Count, JsonSchema, RequestBody, ToolParameters
from api.images.inputs import ImageInput, image_url
from api.images.placed import NO_IMAGES, Images
from api.thinking import Effort, TemplateKwargs, effort_budget, effort_thinks
from events.records import (
    INT32_MAX,
    ChatMessage,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
)

MAX_STOPS = 4
MAX_CHOICES = 8
MAX_TOOLS = 128
# OpenAI's rule for function names.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class ImageUrl(RequestBody):
    url: str
    detail: str | None = None  # the model reads the image as it is, whatever the detail


class ContentPart(RequestBody):
    """A part of a message's content: text, or a user's image (``image_url``). Any other kind
    is refused by the message that holds it, with a message saying so."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None
    # The image an image_url part sends, as its message's validation read it.
    _image: ImageInput | None = PrivateAttr(default=None)

    def piece(self) -> str | ImageInput:
        """What the part adds to its message's content: its text, or its image."""
        return self._image if self._image is not None else self.text or ""


class FunctionCall(RequestBody):
    name: str
    arguments: str = ""


class ToolCallIn(RequestBody):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


# Content kinds the models cannot take: the answer would be about something they never saw.
_UNREADABLE = {
    "input_image": "an image in the Responses API's shape",
    "image": "an image in Anthropic's shape",
    "input_audio": "audio",
    "audio": "audio",
    "file": "a file",
    "input_file": "a file",
}


class Message(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An earlier answer's thinking, sent back (DeepSeek's and vLLM's name, and OpenRouter's).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _readable(self) -> Message:
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            what = _UNREADABLE.get(part.type)
            if what is not None:
                raise ValueError(
                    f"content[{i}] is {what} ({part.type!r}), which Shoal does not take here:"
                    " send text parts, and images as image_url parts"
                )
            if part.type == "image_url":
                if self.role != "user":
                    raise ValueError(f"content[{i}]: only a user message may hold an image")
                if part.image_url is None:
                    raise ValueError(f"content[{i}]: an image_url part needs its image_url")
                try:
                    part._image = image_url(part.image_url.url)
                except ValueError as exc:
                    raise ValueError(f"content[{i}]: {exc}") from None
            elif part.type not in ("text", "refusal") or part.text is None:
                raise ValueError(f"content[{i}]: a part of type {part.type!r} is not supported")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def images(self, index: int) -> list[ImageInput]:
        """The images the message sends (message ``index`` of the request's)."""
        parts = self.content if isinstance(self.content, list) else []
        return [
            replace(p._image, where=f"messages.{index}.content.{j}")
            for j, p in enumerate(parts)
            if p._image is not None
        ]

    def chat_message(self, images: Images = NO_IMAGES) -> ChatMessage:
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in self.tool_calls or []
        ]
        if isinstance(self.content, list):
            content, placed = images.placed(p.piece() for p in self.content)
        else:
            content, placed = self.content or "", []
        # "developer" is the newer name for the system role.
        return ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=content,
            images=placed,
            name=self.name,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
            reasoning=(self.reasoning_content or self.reasoning or None)
            if self.role == "assistant"
            else None,
        )


class FunctionDef(RequestBody):
    name: FunctionName
    description: str = ""
    parameters: ToolParameters | None = None
    strict: bool | None = None  # every call is constrained to the schema anyway


class ToolDef(RequestBody):
    type: str
    function: FunctionDef | None = None

    @model_validator(mode="after")
    def _function(self) -> ToolDef:
        if self.type != "function" or self.function is None:
            raise ValueError(f"tools of type {self.type!r} are not supported: only functions")
        return self


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestBody):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(RequestBody):
    type: str
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _known(self) -> ResponseFormatIn:
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(
                f"response_format type {self.type!r} is not supported: send"
                " 'text', 'json_object' or 'json_schema'"
            )
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs its json_schema")
        return self

    def event(self) -> ResponseFormat | None:
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.type == "json_schema" and self.json_schema is not None:
            return ResponseFormat(
                type="json_schema", name=self.json_schema.name, json_schema=self.json_schema.schema_
            )
        return None


class StreamOptions(RequestBody):
    include_usage: bool = False


class _Sampling(RequestBody):
    # None: the cluster's default model (api/model_names.py).
    model: Annotated[str, Field(min_length=1)] | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=255)] | None = None
    # Common extensions (llama.cpp's server, vLLM, Ollama).
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"logit_bias keys are token ids, and {key!r} is not one")
        return bias

    def params(self, max_tokens: int | None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=[s for s in stops if s],
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repeat_penalty=self.repeat_penalty or 1.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The sampling of choice ``choice`` of ``n``: with a seed, each choice has its own
    (``seed + choice``), so the choices differ and a request sent again gives them again."""
    if choice == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": params.seed + choice})


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatIn | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # A thinking model: "none" turns its thinking off; any other effort lets it think, as
    # long as the effort's budget (api/thinking.py). chat_template_kwargs: as llama.cpp's
    # server and vLLM take them.
    reasoning_effort: Effort | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    # Answer-changing fields Shoal cannot honour (see _unsupported).
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ: send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.audio is not None or (self.modalities and set(self.modalities) - {"text"}):
            raise ValueError("audio output is not supported: the models Shoal serves write text")
        if self.web_search_options is not None:
            raise ValueError("web_search_options is not supported: Shoal's models cannot search")
        if self.functions is not None or self.function_call is not None:
            raise ValueError(
                "functions and function_call are not supported: send tools and tool_choice"
            )
        names = [t.function.name for t in self.tools or [] if t.function is not None]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {choice.function.name!r},"
                " which is not among the tools"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def image_inputs(self) -> list[ImageInput]:
        """The images the messages send, in order."""
        return [image for i, m in enumerate(self.messages) for image in m.images(i)]

    def chat_messages(self, images: Images = NO_IMAGES) -> list[ChatMessage]:
        """The messages, with ``images`` (``image_inputs``, read) in their places."""
        return [m.chat_message(images) for m in self.messages]

    def sampling(self) -> SamplingParams:
        return self.params(self.max_completion_tokens or self.max_tokens)

    def task_fields(self) -> dict[str, Any]:
        """What the task carries besides its messages and sampling."""
        tools = [
            Tool(
                name=t.function.name,
                description=t.function.description,
                parameters=t.function.parameters or {"type": "object", "properties": {}},
            )
            for t in self.tools or []
            if t.function is not None
        ]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            tool_choice = ToolChoice(mode="function", name=choice.function.name)
        else:
            tool_choice = ToolChoice(mode=choice or ("auto" if tools else "none"))
        return {
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": True
            if self.parallel_tool_calls is None
            else self.parallel_tool_calls,
            "response_format": self.response_format.event() if self.response_format else None,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "thinking": effort_thinks(self.reasoning_effort),
            "thinking_budget": effort_budget(self.reasoning_effort),
            "chat_template_kwargs": self.chat_template_kwargs or {},
        }


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for completions; 0 is allowed with echo (scoring a text).
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> Any:
        # A list of ints is one prompt, as token ids; other lists hold prompts.
        if (
            isinstance(prompt, list)
            and len(prompt) != 1
            and (not prompt or not isinstance(prompt[0], int))
        ):
            raise ValueError("send one prompt per request")
        return prompt

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it needs echo")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported: send n for several choices")
        return self

    def text(self) -> str | None:
        """The prompt as text; None when it was sent as token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        return p[0] if p and isinstance(p[0], str) else None

    def token_ids(self) -> list[int] | None:
        p = self.prompt
        if p and isinstance(p[0], int):
            return [t for t in p if isinstance(t, int)]
        if p and isinstance(p[0], list):
            return list(p[0])
        return None

    def sampling(self) -> SamplingParams:
        return self.params(self.max_tokens)

    def task_fields(self) -> dict[str, Any]:
        # A prompt's scores are needed for its logprobs, and for its text if it came as ids.
        scored = self.echo and (self.logprobs is not None or self.text() is None)
        return {"logprobs": self.logprobs, "echo": scored}

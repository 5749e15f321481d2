"""The OpenAI request bodies Shoal accepts, and how they become a ``TaskCreated``.

Fields OpenAI defines that Shoal does not use (logprobs, tools...) are ignored, as OpenAI's
SDKs send some of them by default; fields Shoal uses are checked, each with a clear message.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bus.events import INT32_MAX, ChatMessage, SamplingParams

MAX_STOPS = 4
# Token counts and context lengths: positive, and small enough for the projection's columns.
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=255)] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported: send several requests for several choices")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return stop

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
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Count | None = None

    @model_validator(mode="after")
    def _limits_agree(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ: send one of them")
        return self

    def chat_messages(self) -> list[ChatMessage]:
        # "developer" is the newer name for the system role.
        return [
            ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text(),
                        name=m.name)
            for m in self.messages
        ]  # fmt: skip

    def sampling(self) -> SamplingParams:
        return self.params(self.max_completion_tokens or self.max_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: Count | None = 16  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("send one prompt per request")
        return prompt

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def sampling(self) -> SamplingParams:
        return self.params(self.max_tokens)


class InstanceRequest(_Body):
    model: Annotated[str, Field(min_length=1)]
    placement: str | dict[str, object] | None = Field(
        default=None, description="A placement spec, as JSON text or as an object."
    )
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    context_length: Count | None = None
    queue: bool = Field(default=False, description="Request it even if it cannot be placed now.")

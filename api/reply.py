"""One task's answer as its chunks arrive, in no dialect's words: the text, a thinking model's
thinking, the tool calls, the log-probabilities and why it ended. Every dialect's whole
response is made from these."""

from __future__ import annotations

from dataclasses import dataclass, field

from events.catalogue import ChunkGenerated
from events.records import FinishReason, TokenLogprob


@dataclass
class Call:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class Reply:
    text: str = ""
    reasoning: str = ""
    calls: dict[int, Call] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # The stop sequence that ended it, when one did.
    stop_sequence: str | None = None

    def add(self, chunk: ChunkGenerated) -> None:
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        for d in chunk.tool_calls:
            call = self.calls.setdefault(d.index, Call())
            call.id = d.id or call.id
            call.name = d.name or call.name
            call.arguments += d.arguments
        if chunk.logprob is not None:
            self.logprobs.append(chunk.logprob)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_sequence = chunk.stop_sequence

    def tool_calls(self) -> list[Call]:
        return [c for _, c in sorted(self.calls.items())]

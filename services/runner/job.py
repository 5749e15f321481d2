"""What a task asks of the engine: its prompt as tokens, how to pick the next ones, and how to
read the reply (content and tool calls, in the model's format)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from bus.events import PromptScored, TaskCreated
from services.runner.decoding import Decoding
from services.runner.engines.base import Engine
from services.runner.generation import InvalidRequest, PlainReply, ReplyParser, ScoredPrompt
from services.runner.structured import plan_reply

# Prompt tokens per PromptScored event: with 20 alternatives each, 64 entries stay far below a
# NATS message's 1 MiB.
PROMPT_SLICE = 64


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    decoding: Decoding
    reply: ReplyParser


def prepare(engine: Engine, task: TaskCreated) -> Job:
    """Raises ``InvalidRequest`` for a task the engine cannot serve as asked."""
    grammar = None
    reply: ReplyParser = PlainReply()
    if task.prompt_token_ids is not None:
        prompt = list(task.prompt_token_ids)
        _in_vocabulary(engine, prompt, "the prompt")
    elif task.kind == "completion" or task.messages is None:
        if task.prompt is None:
            raise InvalidRequest("a completion task needs a prompt")
        prompt = engine.text_tokens(task.prompt)
    else:
        plan = plan_reply(task, engine.chat_template)
        prompt = engine.chat_tokens(plan.messages, plan.tools)
        grammar, reply = plan.grammar, plan.parser()
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    return Job(prompt, Decoding(task.params, grammar, task.logprobs, task.echo), reply)


def _in_vocabulary(engine: Engine, tokens: Iterable[int], what: str) -> None:
    outside = [t for t in tokens if not 0 <= t < engine.n_vocab]
    if outside:
        raise InvalidRequest(f"{what} has token {outside[0]}, outside the model's vocabulary"
                             f" of {engine.n_vocab} tokens")  # fmt: skip


def prompt_scored(
    task: TaskCreated, scored: ScoredPrompt, origin: str, ts: float
) -> Iterator[PromptScored]:
    """The prompt's scores as events, ``PROMPT_SLICE`` tokens each."""
    at = datetime.fromtimestamp(ts, UTC)
    total = len(scored.tokens)
    for start in range(0, total, PROMPT_SLICE):
        yield PromptScored(task_id=task.task_id, origin=origin, ts=at, start=start, total=total,
                           tokens=scored.tokens[start : start + PROMPT_SLICE])  # fmt: skip

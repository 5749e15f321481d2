"""What a task asks of the engine: its prompt as tokens, how to pick the next ones, and how to
read the reply (content and tool calls, in the model's format)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from events.attempts import attempt_of
from events.catalogue import PromptScored, TaskCreated
from events.images import decode_refusal
from inference.decoding import Decoding, ThinkingBudget
from inference.engines.base import Engine, ReadsImages, Tokenizer
from inference.generation import ScoredPrompt
from inference.image_markers import with_placeholders
from inference.image_spans import ImagePrompt
from structured import ReplyPlan, plan_reply
from structured.reasoning import (
    THINK_CLOSE,
    template_kwargs,
    thinking_reply,
    thinking_start,
)
from structured.reasoning_grammar import think_first
from structured.reply import InvalidRequest, PlainReply, ReplyParser
from structured.schema_checks import schemas_problem, task_schemas

# Prompt tokens per PromptScored event: with 20 alternatives each, 64 entries stay far below a
# NATS message's 1 MiB.
PROMPT_SLICE = 64
# The prompt's last tokens, read for whether the template opened (or closed) the thinking.
_PROMPT_END = 16
# What ends a thinking whose budget is spent: the tag, and the blank line a model writes
# before its answer.
CLOSE = f"\n{THINK_CLOSE}\n\n"


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    decoding: Decoding
    reply: ReplyParser


# How long a task's schemas may take to become its grammar: past it, the task fails alone (a
# 400 to its client); the thread that builds it runs on to its end, but the runner's loop,
# which serves its other tasks' chunks, heartbeats and claims, never waits for it.
GRAMMAR_BUDGET_S = 10.0


async def prepared(
    engine: Engine,
    task: TaskCreated,
    images: Mapping[str, bytes] | None = None,
    budget_s: float = GRAMMAR_BUDGET_S,
) -> Job:
    """``prepare``, off the event loop where it may take long: a task with schemas (its
    grammar is built; ``budget_s`` at most) or images (decoded and preprocessed: milliseconds
    to tens); a plain one on the loop (no thread hop before its first token)."""
    schemas = task_schemas(task.tools, task.response_format)
    if not schemas:
        if not images:
            return prepare(engine, task)
        return await asyncio.to_thread(prepare, engine, task, images)
    if (found := schemas_problem(schemas)) is not None:  # as the API checks
        raise InvalidRequest(f"{found[0]}: {found[1]}")
    try:
        return await asyncio.wait_for(asyncio.to_thread(prepare, engine, task, images), budget_s)
    except TimeoutError:
        raise InvalidRequest(
            f"the request's schemas took more than {budget_s:g} s to become a grammar: send"
            " smaller ones (fewer optional properties)"
        ) from None


def prepare(engine: Engine, task: TaskCreated, images: Mapping[str, bytes] | None = None) -> Job:
    """Raises ``InvalidRequest`` for a task the engine cannot serve as asked. ``images``: the
    bytes of the task's images, by digest (``services/runner/images.py``)."""
    grammar = None
    reply: ReplyParser = PlainReply()
    budget = None
    shown: ImagePrompt | None = None
    if task.prompt_token_ids is not None:
        prompt = list(task.prompt_token_ids)
        _in_vocabulary(engine, prompt, "the prompt")
    elif task.kind == "completion" or task.messages is None:
        if task.prompt is None:
            raise InvalidRequest("a completion task needs a prompt")
        prompt = engine.text_tokens(task.prompt)
    else:
        template = engine.chat_template
        plan, shown = _planned(engine, task, images or {})
        prompt = _rendered(engine, task, plan) if shown is None else shown.tokens
        end = b"".join(engine.spelled(t) for t in prompt[-_PROMPT_END:])
        start = thinking_start(template, end.decode(errors="replace"))
        grammar, reply = think_first(plan.grammar, start), thinking_reply(plan.parser(), start)
        if start != "none" and task.thinking is not False:
            budget = thinking_budget(engine, task.thinking_budget)
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    decoding = Decoding(
        task.params,
        grammar,
        task.logprobs,
        task.echo,
        thinking_budget=budget,
        images=shown.images if shown is not None else (),
    )
    if task.resume is not None:
        decoding = resumed(decoding, task.resume.tokens)
        _in_vocabulary(engine, decoding.generated, "the generated text")
    return Job(prompt, decoding, reply)


def thinking_budget(engine: Tokenizer, tokens: int | None) -> ThinkingBudget | None:
    """A task's thinking budget (None: unbounded), with the tokens that close the thinking in
    the engine's vocabulary: ``CLOSE``, its ``</think>`` the model's own token where it has one
    (Qwen3's, R1's), as llama.cpp's server forces them."""
    if tokens is None:
        return None
    close = engine.tokenize(CLOSE, add_special=False, parse_special=True)
    return ThinkingBudget(tokens, tuple(close))


def chat_prompt(
    engine: Engine,
    task: TaskCreated,
    add_generation_prompt: bool = True,
    images: Mapping[str, bytes] | None = None,
) -> list[int]:
    """A chat task's prompt tokens, made as ``prepare`` makes them (its tools, tool choice,
    response format and thinking included; an image's tokens are its ``image_token``),
    without preparing the rest: what counting a chat's tokens answers. Raises
    ``InvalidRequest`` as ``prepare`` does."""
    plan, shown = _planned(engine, task, images or {}, add_generation_prompt)
    return _rendered(engine, task, plan, add_generation_prompt) if shown is None else shown.tokens


def _planned(
    engine: Engine,
    task: TaskCreated,
    images: Mapping[str, bytes],
    add_generation_prompt: bool = True,
) -> tuple[ReplyPlan, ImagePrompt | None]:
    """The chat's reply plan; for a chat with images, also its prompt as the engine reads it
    (each image where it goes in its message, through the chat template)."""
    if not any(m.images for m in task.messages or []):
        return plan_reply(task, engine.chat_template), None
    if not isinstance(engine, ReadsImages):
        raise InvalidRequest("this engine reads no images")
    messages, shown = with_placeholders(task.messages or [])
    if (too_many := decode_refusal(shown)) is not None:  # before any is decoded
        raise InvalidRequest(too_many)
    missing = sorted({i.sha256 for i in shown} - set(images))
    if missing:  # never served as if the image were not there
        raise InvalidRequest(f"image {missing[0]} of the chat was not read")
    plan = plan_reply(task.model_copy(update={"messages": messages}), engine.chat_template)
    kwargs = template_kwargs(engine.chat_template, task.thinking, task.chat_template_kwargs)
    prompt = engine.image_chat_prompt(
        plan.messages, plan.tools, kwargs, add_generation_prompt, [images[i.sha256] for i in shown]
    )
    return plan, prompt


def _rendered(
    engine: Engine, task: TaskCreated, plan: ReplyPlan, add_generation_prompt: bool = True
) -> list[int]:
    kwargs = template_kwargs(engine.chat_template, task.thinking, task.chat_template_kwargs)
    return engine.chat_tokens(plan.messages, plan.tools, kwargs, add_generation_prompt)


def resumed(decoding: Decoding, generated: Sequence[int]) -> Decoding:
    """How a task resumed after ``generated`` goes on: after those tokens, its prompt's scores
    not given again, and a seed of its own for what follows (``continued_seed``)."""
    params = decoding.params
    if params.seed is not None:
        params = params.model_copy(update={"seed": continued_seed(params.seed, len(generated))})
    return replace(decoding, params=params, echo=False, generated=tuple(generated))


def continued_seed(seed: int, position: int) -> int:
    """The seed a seeded task goes on with after ``position`` generated tokens: a resumed
    draw cannot continue the lost runner's random state, so it takes a new one that the task's
    seed and the position fix (the same resume draws the same tokens)."""
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:4])


def _in_vocabulary(engine: Engine, tokens: Iterable[int], what: str) -> None:
    outside = [t for t in tokens if not 0 <= t < engine.n_vocab]
    if outside:
        raise InvalidRequest(
            f"{what} has token {outside[0]}, outside the model's vocabulary"
            f" of {engine.n_vocab} tokens"
        )


def prompt_scored(
    task: TaskCreated, scored: ScoredPrompt, origin: str, ts: float
) -> Iterator[PromptScored]:
    """The prompt's scores as events, ``PROMPT_SLICE`` tokens each, of the task's attempt."""
    at = datetime.fromtimestamp(ts, UTC)
    total = len(scored.tokens)
    attempt = attempt_of(task).number
    for start in range(0, total, PROMPT_SLICE):
        yield PromptScored(
            task_id=task.task_id,
            origin=origin,
            ts=at,
            start=start,
            total=total,
            tokens=scored.tokens[start : start + PROMPT_SLICE],
            attempt=attempt,
        )

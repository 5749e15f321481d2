"""From a token source to chunks: the part of serving a task that every engine shares.

An engine gives token ids and their bytes; this turns them into ``Step``s, one per generated
token, with text that is valid UTF-8, stop strings applied, and the finish reason on a last
step. It checks for cancellation between tokens, so a cancel stops generation within one token;
engines check it between a prompt's prefill chunks too (``Decoding.cancelled``).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from events.records import FinishReason, SamplingParams, TokenLogprob, ToolCallDelta, TopLogprob
from inference.decoding import MAX_TOP_LOGPROBS, Decoding, PromptCached, PromptScores, Token
from inference.stops import StopMatcher
from structured.reply import InvalidRequest, PlainReply, ReplyParser


class TokenSource(Protocol):
    def generate(
        self, prompt: list[int], decoding: Decoding
    ) -> Iterator[Token | PromptScores | PromptCached]:
        """Token ids after ``prompt``, picked as ``decoding`` says, until the caller stops
        (or the engine stops after an end token, its context full or ``max_tokens`` made);
        first, when ``decoding.echo``, the prompt's own ``PromptScores``, and when a cache held
        the prompt's start, ``PromptCached``. Lazy: nothing is computed before the first
        ``next()``."""
        ...

    def piece(self, token: int) -> bytes:
        """The token's bytes as the reply shows them: special tokens show none."""
        ...

    def spelled(self, token: int) -> bytes:
        """The token's text with special tokens spelled out (``<|python_tag|>``): what a reply
        parser may look for."""
        ...

    def is_end(self, token: int) -> bool:
        """End of generation (EOS, end of turn)."""
        ...


@dataclass(frozen=True)
class Step:
    """One chunk: a generated token (``token_id`` set) or the final marker (``finish_reason``
    set, ``token_id`` None, carrying any text that was held back)."""

    idx: int
    text: str
    token_id: int | None
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # On the final marker of a reply that a stop string ended: that string.
    stop_sequence: str | None = None
    reasoning: str = ""
    # On the final marker: how many of the generated tokens were the thinking.
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class ScoredPrompt:
    """The prompt's tokens with their log-probabilities (a task with ``echo``), before any
    step."""

    tokens: tuple[TokenLogprob, ...]


class PromptTooLong(InvalidRequest):
    """The prompt leaves no room in the model's context: both counts go on TaskFailed, for the
    API to say so in each dialect's words (Anthropic's are what Claude Code compacts on)."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens, more than the model's context of "
            f"{context_length} tokens leaves room for"
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


def check_against_vocabulary(
    params: SamplingParams, n_vocab: int, top_logprobs: int | None
) -> None:
    """What depends on the model's vocabulary, checked by every engine before it computes
    anything (the value ranges are ``check_request``'s)."""
    outside = sorted(t for t in params.logit_bias if not 0 <= t < n_vocab)
    if outside:
        raise InvalidRequest(
            f"logit_bias names token {outside[0]}, outside the model's vocabulary of"
            f" {n_vocab} tokens"
        )
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}"
        )


def check_request(
    prompt_tokens: int, params: SamplingParams, n_ctx: int, echo: bool = False
) -> int:
    """Validate a request against the model; returns how many tokens may be generated. A task
    that scores its prompt (``echo``) may ask for none."""
    least = 0 if echo else 1
    if params.max_tokens is not None and params.max_tokens < least:
        raise InvalidRequest(f"max_tokens must be at least {least}, got {params.max_tokens}")
    if params.top_k < 0:
        raise InvalidRequest(f"top_k must be 0 (off) or more, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise InvalidRequest(f"min_p must be between 0 and 1, got {params.min_p}")
    if params.repeat_penalty <= 0.0:
        raise InvalidRequest(f"repeat_penalty must be above 0, got {params.repeat_penalty}")
    for token, bias in params.logit_bias.items():
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequest(f"logit_bias of token {token} must be between -100 and 100")
    if not 0.0 <= params.temperature <= 2.0:
        raise InvalidRequest(f"temperature must be between 0 and 2, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"{name} must be between -2 and 2, got {value}")
    if prompt_tokens >= n_ctx:
        raise PromptTooLong(prompt_tokens, n_ctx)
    room = n_ctx - prompt_tokens
    return min(room, params.max_tokens) if params.max_tokens is not None else room


class Stepper:
    """What ``steps`` does, one engine item at a time: for an engine that pushes its items
    (a batch decoder calls ``take`` from its own thread) as for one that is pulled from."""

    def __init__(
        self,
        source: TokenSource,
        decoding: Decoding,
        limit: int,
        cancelled: Callable[[], bool],
        reply: ReplyParser | None = None,
        on_cached: Callable[[int], None] | None = None,
    ) -> None:
        self._source = source
        self._limit = limit
        self._cancelled = cancelled
        self._reply = reply or PlainReply()
        self._on_cached = on_cached
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._matcher = StopMatcher(decoding.params.stop)
        self._idx = 0
        self._finish: FinishReason = "length"
        self._stopped_by: str | None = None
        self._thinking = 0  # tokens of the thinking
        self._budget = decoding.thinking_budget
        self._forced = decoding.forced
        self._open = False  # the reply is inside its thinking
        self._closing: list[int] = []  # the closing tag's tokens put, not yet taken
        self._closed = False  # the budget's closing tag was put (once a task)
        # Whether the engine is asked at all (with a limit of 0, only for the prompt's scores).
        self.wants = limit > 0 or decoding.echo

    def take(
        self, item: Token | PromptScores | PromptCached
    ) -> tuple[list[Step | ScoredPrompt], bool]:
        """The steps an engine item makes, and whether more items are wanted."""
        source = self._source
        if isinstance(item, PromptCached):
            if self._on_cached is not None:
                self._on_cached(item.tokens)
            return [], True
        if isinstance(item, PromptScores):
            return [ScoredPrompt(tuple(_scored_prompt(source, item.tokens)))], self._limit > 0
        if self._cancelled():
            self._finish = "cancelled"
            return [], False
        token = item.id
        if source.is_end(token):
            self._finish = "stop"
            return [], False
        piece = source.piece(token)
        raw = self._decoder.decode(piece)
        reply = self._reply
        if not piece and reply.markers:
            spelled = source.spelled(token).decode(errors="replace")
            raw = spelled if spelled in reply.markers else raw
        out = self._matcher.feed(raw)
        parsed = reply.feed(out.text)
        logprob = _logprob(source, item, raw, piece) if item.logprob is not None else None
        step = Step(
            self._idx,
            parsed.text,
            token,
            logprob=logprob,
            tool_calls=parsed.calls,
            reasoning=parsed.reasoning,
        )
        self._idx += 1
        if parsed.thinking:
            self._thinking += 1
        self._open = parsed.thinking_open
        self._spend(token)
        if parsed.ended:  # a repeated call: the model would only go on repeating
            self._finish, self._stopped_by = "tool_calls", None
            return [step], False
        if out.stopped:  # what came after the stop string is dropped with it
            self._finish, self._stopped_by = "stop", out.stop
            self._decoder.reset()
            return [step], False
        if self._idx >= self._limit:
            return [step], False
        if self._cancelled():
            self._finish = "cancelled"
            return [step], False
        return [step], True

    def replay(self, tokens: Sequence[int]) -> bool:
        """Take tokens generated before (a resumed task) as if the engine gave them, their
        steps dropped (they were published): the text, stops and tool calls go on from there.
        Whether more tokens are wanted."""
        more = self.wants
        for token in tokens:
            if not more:
                break
            _, more = self.take(Token(token))
        # The lost runner's forced tokens are among those taken: what it had not yet
        # generated of the closing tag is forced next.
        self._forced.clear()
        self._forced.put(self._closing)
        return more

    def _spend(self, token: int) -> None:
        """The thinking budget, after ``token`` was taken: once the thinking has its budget's
        tokens and is still open, its closing tag is put for the engine to generate next
        (``Decoding.forced``), once a task. A thinking the model closed itself (an engine that
        samples ahead took no forced token yet) forces nothing more."""
        budget = self._budget
        if budget is None:
            return
        if self._closing and token == self._closing[0]:
            self._closing.pop(0)  # a forced token taken
        elif self._closing and not self._open:
            self._forced.clear()
            self._closing.clear()
        if not self._closed and self._open and self._thinking >= budget.tokens:
            self._closed = True
            self._closing = list(budget.close)
            self._forced.put(budget.close)

    def finish(self) -> Step:
        """The last step, once the engine gave its last item (or was told to stop)."""
        if self._finish == "length" and self._idx < self._limit and self._cancelled():
            # The engine ended short of the limit because it was told to: a cancel during the
            # prompt's prefill (``Decoding.cancelled``), before any token came to be taken.
            self._finish = "cancelled"
        if self._finish == "cancelled":
            return Step(self._idx, "", None, "cancelled", reasoning_tokens=self._thinking)
        matcher, reply = self._matcher, self._reply
        tail = matcher.feed(self._decoder.decode(b"", final=True)).text + matcher.flush()
        parsed = reply.feed(tail)
        rest = reply.finish()
        finish, stopped_by = self._finish, self._stopped_by
        if (finish == "stop" and reply.called) or parsed.ended or rest.ended:
            finish, stopped_by = "tool_calls", None
        return Step(
            self._idx,
            parsed.text + rest.text,
            None,
            finish,
            tool_calls=parsed.calls + rest.calls,
            stop_sequence=stopped_by,
            reasoning=parsed.reasoning + rest.reasoning,
            reasoning_tokens=self._thinking,
        )


def steps(
    source: TokenSource,
    prompt: list[int],
    decoding: Decoding,
    limit: int,
    cancelled: Callable[[], bool],
    reply: ReplyParser | None = None,
    on_cached: Callable[[int], None] | None = None,
) -> Iterator[Step | ScoredPrompt]:
    """Generate at most ``limit`` tokens. Every token gives a Step; the last Step has the
    finish reason: "stop" (end token or stop string), "tool_calls" (stopped after a tool
    call, or at a call repeating an earlier one), "length" (limit), "cancelled"; and how many
    tokens were the thinking. With ``decoding.echo`` a ``ScoredPrompt`` comes first, even
    with a limit of 0. ``on_cached`` is told how many of the prompt's tokens the
    engine's cache held (when it says). A resumed task's ``decoding.generated`` tokens count as
    generated (their steps are not given again), and the engine goes on after them."""
    stepper = Stepper(source, decoding, limit, cancelled, reply, on_cached)
    if stepper.replay(decoding.generated):
        for item in source.generate(prompt + list(decoding.generated), decoding):
            made, more = stepper.take(item)
            yield from made
            if not more:
                break
    yield stepper.finish()


def _logprob(source: TokenSource, token: Token, text: str, piece: bytes) -> TokenLogprob:
    """A generated token's entry: its text as the reply shows it (a piece of a character
    shows as nothing, the character with the token that completes it), so that the entries'
    texts add up to the text."""
    assert token.logprob is not None
    return TokenLogprob(
        token=text, logprob=token.logprob, bytes=tuple(piece), top=_alternatives(source, token.top)
    )


def _scored_prompt(source: TokenSource, tokens: Sequence[Token]) -> Iterator[TokenLogprob]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in tokens:
        piece = source.piece(t.id)
        yield TokenLogprob(
            token=decoder.decode(piece),
            logprob=t.logprob,
            bytes=tuple(piece),
            top=_alternatives(source, t.top),
        )


def _alternatives(source: TokenSource, top: Sequence[tuple[int, float]]) -> tuple[TopLogprob, ...]:
    pieces = ((source.piece(token_id), logprob) for token_id, logprob in top)
    return tuple(
        TopLogprob(token=piece.decode(errors="replace"), logprob=logprob, bytes=tuple(piece))
        for piece, logprob in pieces
    )

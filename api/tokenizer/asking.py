"""Asking a runner of a model about the model's tokenizer: the one way the API counts tokens
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``, Anthropic's ``count_tokens``).

The API has no tokenizer (it loads no model), so the answer comes from a chat runner of the
model, over core NATS request-reply to ``shoal.tokenizer.<model>`` (``events/tokenizer.py``): the
runners of the model share a queue group, and one of them answers. Not a task on the log: a
question changes nothing, so no event is stored for it, and the round trip is one message each
way, where a task would take two stored events, a consumer's delivery and a chunk
subscription, and wait for a free slot: milliseconds before the runner starts, against a
target of 10 ms added over tokenizing in process (``bench/tokenize.py``, docs/api.md).

Before asking, the model must serve, as for a chat: a model nothing serves is loaded on demand
(``require_serving``), an unknown one is a 404.
"""

from __future__ import annotations

import nats.errors

from api.context import ApiContext
from api.errors import ApiError
from api.serving import checked
from events.subjects import tokenizer_subject
from events.tokenizer import TokenizerAnswer, TokenizerAsk, TokenizerQuestion

# How long the API waits for the answer: a runner answers within milliseconds, a long chat's
# template within a second.
ANSWER_WITHIN_S = 30.0


async def ask(
    ctx: ApiContext, model_id: str, question: TokenizerAsk, param: str | None = None
) -> TokenizerAnswer:
    """The answer of a runner of ``model_id`` to ``question``; ``ApiError`` otherwise, in the
    route's dialect: 400 for a question the tokenizer refuses (``param``: the request's field
    it is about), 413 for a question or answer larger than a NATS message, 404/503 as for a
    chat (an unknown model, one that cannot serve now), 504 when no answer comes."""
    await checked(ctx, model_id, why=f"loaded on demand: a tokenizer request for {model_id}")
    data = TokenizerQuestion(ask=question).model_dump_json().encode()
    limit = ctx.nc.max_payload
    if len(data) > limit:
        raise ApiError(
            413,
            f"The request is too large: {len(data)} bytes to the model's runner, more than the"
            f" {limit} bytes a NATS message may hold. Shorten it.",
            param=param,
            code="request_too_large",
        )
    try:
        reply = await ctx.nc.request(tokenizer_subject(model_id), data, timeout=ANSWER_WITHIN_S)
    except nats.errors.NoRespondersError:
        raise ApiError(
            503,
            f"model `{model_id}` has no runner that answers now (its last one stopped); try again",
            code="model_not_ready",
        ) from None
    except nats.errors.TimeoutError:
        raise ApiError(
            504, f"no runner of `{model_id}` answered within {ANSWER_WITHIN_S:g} s"
        ) from None
    except nats.errors.Error as exc:
        raise ApiError(
            503, f"NATS is unavailable ({type(exc).__name__}); try again", code="nats_unavailable"
        ) from None
    answer = TokenizerAnswer.model_validate_json(reply.data)
    if answer.refused == "too_large":
        raise ApiError(413, str(answer.error), param=param, code="request_too_large")
    if answer.refused == "failed":
        raise ApiError(500, f"the model's tokenizer failed: {answer.error}")
    if answer.refused is not None:
        raise ApiError(400, str(answer.error), param=param, code="invalid_request")
    return answer

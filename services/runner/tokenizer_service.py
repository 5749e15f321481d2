"""A chat runner answering questions about its model's tokenizer (``events/tokenizer.py``): it
joins the model's queue group on ``shoal.tokenizer.<model>`` before it reports Ready (so a
model the API finds serving has someone to answer), and leaves it when it stops serving.

Core NATS request-reply, not a task: a question changes nothing, so nothing is stored, and it
is answered whether or not the runner's slots are busy (tokenizing only reads the vocabulary,
beside the decoding thread: on the event loop when it is short, else on a thread of its own).
One runner of the queue group answers each question; the others never see it. A chat's images
are read from their parts first, as a task's are (``images.py``): counted as the model reads
them.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from bus.stores.parts import PartMissing, PartStore
from events.subjects import TOKENIZER_QUEUE, tokenizer_subject
from events.tokenizer import TokenizeChat, TokenizerAnswer, TokenizerAsk, TokenizerQuestion
from inference.engines.base import Engine
from services.runner.images import images_for
from services.runner.tokenizer_answers import answer
from structured.reply import InvalidRequest

log = logging.getLogger(__name__)

# A question this small (a few thousand tokens: milliseconds) is answered on the event loop: a
# hand-off to the tokenizer's thread and back is two wake-ups, which on a busy machine cost
# more than the tokenizing. Larger ones go to the thread, so that chunks keep going out.
INLINE_BYTES = 16 * 1024


class TokenizerService:
    def __init__(self, nc: Client, engine: Engine, model_id: str) -> None:
        self._nc = nc
        self._engine = engine
        self._subject = tokenizer_subject(model_id)
        self._parts = PartStore(nc.jetstream())
        self._sub: Subscription | None = None
        # Large questions off the event loop, which publishes the chunks of the tasks being
        # generated: a long text or chat takes tens of milliseconds.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.answered = 0

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subject, queue=TOKENIZER_QUEUE, cb=self._on_ask)
        # Started means the server has it: an API asking on another connection right after
        # is answered, not told that no runner answers.
        await self._nc.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection is closing: nothing to leave
                log.debug("leaving %s", self._subject, exc_info=True)
            self._sub = None
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _on_ask(self, msg: Msg) -> None:
        try:
            question = TokenizerQuestion.model_validate_json(msg.data)
        except ValidationError as exc:
            reply = TokenizerAnswer(refused="invalid_request", error=f"malformed question: {exc}")
        else:
            try:
                images = await self._images(question.ask)
                if len(msg.data) <= INLINE_BYTES and not images:
                    reply = answer(self._engine, question.ask)
                else:
                    loop = asyncio.get_running_loop()
                    reply = await loop.run_in_executor(
                        self._thread, answer, self._engine, question.ask, images
                    )
            except (InvalidRequest, PartMissing) as exc:
                reply = TokenizerAnswer(
                    n_ctx=self._engine.n_ctx, refused="invalid_request", error=str(exc)
                )
            except Exception as exc:  # the asker gets why at once, not a timeout
                log.exception("a tokenizer question failed")
                reply = TokenizerAnswer(refused="failed", error=f"{type(exc).__name__}: {exc}")
        await msg.respond(self._fitting(reply))
        self.answered += 1

    async def _images(self, ask: TokenizerAsk) -> dict[str, bytes]:
        """The bytes of a chat's images (none for any other question)."""
        if not isinstance(ask, TokenizeChat):
            return {}
        return await images_for(self._parts, self._engine, ask.task)

    def _fitting(self, reply: TokenizerAnswer) -> bytes:
        """The answer as sent: one that is larger than a NATS message may be (the server
        would close the connection over it) says so instead."""
        data = reply.model_dump_json(exclude_none=True).encode()
        limit = self._nc.max_payload
        if len(data) <= limit:
            return data
        too_large = TokenizerAnswer(
            n_ctx=reply.n_ctx,
            refused="too_large",
            error=f"the answer is {len(data)} bytes, more than the {limit} bytes a NATS message"
            " may hold: send a shorter text",
        )
        return too_large.model_dump_json(exclude_none=True).encode()

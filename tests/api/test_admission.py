"""Admission control: the pure scheduler (bound, fairness order, release), the waiting around
it, and the 429 in each dialect."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam
from starlette.types import Message

from api.admission import (
    NOBODY,
    QUEUE_PER_SLOT,
    Admission,
    Caller,
    Refusal,
    Scheduler,
    Ticket,
    group_of,
    queue_full,
    retry_after_s,
)
from api.errors import ApiError, error_response
from api.keys import given_key
from api.projection import serving_slots
from api.serving_verdicts import ServingVerdicts
from bus.embedded import free_port
from cli.state import read_admission
from events.kinds import InstanceRole
from events.states import InstanceStatus, RunnerState
from harness.processes import SHOAL, wait_healthy
from harness.shoal_up import Drained, start
from projectors.rows import InstanceRow, RunnerRow
from projectors.state import ClusterState, Put
from tests.api.up_cluster import UpCluster
from tests.cli.shoal_up import KEY, MODEL


def admitted(got: Ticket | Refusal) -> Ticket:
    assert isinstance(got, Ticket) and got.admitted_at is not None, got
    return got


def queued(got: Ticket | Refusal) -> Ticket:
    assert isinstance(got, Ticket) and got.admitted_at is None, got
    return got


def sched(capacity: int, max_queued: int | None = None) -> Scheduler:
    s = Scheduler(max_queued)
    assert s.resize("m", capacity, 0.0) == []
    return s


def test_up_to_capacity_is_admitted_then_queued_then_refused_with_retry_after() -> None:
    s = sched(2, max_queued=1)
    a, b = admitted(s.arrive("m", "k", 1, 0.0)), admitted(s.arrive("m", "k", 1, 0.0))
    c = queued(s.arrive("m", "k", 1, 0.0))
    refused = s.arrive("m", "other", 1, 0.0)
    assert refused == Refusal("m", capacity=2, queued=1, max_queued=1, retry_after_s=1)
    snap = s.snapshot(3.0)[0]
    assert (snap.in_flight, snap.queued, snap.rejected, snap.oldest_wait_s) == (2, 1, 1, 3.0)
    # A slot frees: the queued one runs, and there is room in the queue again.
    assert s.finish(a, 4.0) == [c] and c.waited_s == 4.0
    assert s.refusal("m") is None
    assert [t.admitted_at for t in (b, c)] == [0.0, 4.0]
    # Another model has its own slots and queue.
    admitted(s.arrive("n", "k", 1, 4.0))


def test_the_default_bound_is_per_slot_and_zero_refuses_at_once() -> None:
    s = sched(3)
    assert s.limit("m") == 3 * QUEUE_PER_SLOT
    none = sched(1, max_queued=0)
    admitted(none.arrive("m", "k", 1, 0.0))
    assert isinstance(none.arrive("m", "k", 1, 0.0), Refusal)


def test_keys_with_queued_work_take_turns_fifo_within_a_key() -> None:
    s = sched(1)
    first = admitted(s.arrive("m", "a", 1, 0.0))
    waiting = [queued(s.arrive("m", key, 1, 0.0)) for key in ("a", "a", "a", "b", "b")]
    order: list[str] = []
    running = first
    for now in range(1, 6):
        (running,) = s.finish(running, float(now))
        order.append(f"{running.group}{waiting.index(running)}")
    # b had none served: it goes first; then turns, each key's requests in their order.
    assert order == ["b3", "a0", "b4", "a1", "a2"]


def test_a_freed_slot_goes_to_the_key_with_fewest_tasks_in_flight() -> None:
    s = sched(3)
    hog = [admitted(s.arrive("m", "a", 1, 0.0)) for _ in range(3)]
    more = [queued(s.arrive("m", "a", 1, 0.0)) for _ in range(2)]
    late = queued(s.arrive("m", "b", 1, 1.0))
    # a queued first, but holds every slot: b's request is released first.
    assert s.finish(hog[0], 2.0) == [late]
    assert s.finish(hog[1], 3.0) == [more[0]]


def test_a_request_of_n_tasks_holds_n_slots_and_is_not_overtaken() -> None:
    s = sched(2)
    one = admitted(s.arrive("m", "a", 1, 0.0))
    pair = queued(s.arrive("m", "b", 2, 0.0))  # does not fit beside one
    small = queued(s.arrive("m", "c", 1, 0.0))  # would fit, but waits its turn
    assert s.snapshot(0.0)[0].in_flight == 1
    assert s.finish(one, 1.0) == [pair]
    assert s.snapshot(1.0)[0].in_flight == 2
    assert s.finish(pair, 2.0) == [small]  # one of the pair's two tasks ended
    # More tasks than the capacity: run alone once nothing is in flight, rather than never.
    big = sched(2)
    alone = admitted(big.arrive("m", "a", 3, 0.0))
    assert big.snapshot(0.0)[0].in_flight == 3
    after = queued(big.arrive("m", "a", 1, 0.0))
    assert big.finish(alone, 1.0) == []  # 2 of 2 slots still taken
    assert big.finish(alone, 1.0) == [after]


def test_finishing_more_tasks_than_admitted_or_a_queued_one_changes_nothing() -> None:
    s = sched(1)
    a = admitted(s.arrive("m", "a", 1, 0.0))
    b = queued(s.arrive("m", "b", 1, 0.0))
    assert s.finish(b, 1.0) == []  # not admitted: nothing to free
    assert s.finish(a, 1.0) == [b]
    assert s.finish(a, 2.0) == []  # its one task ended already
    assert s.snapshot(2.0)[0].in_flight == 1


def test_a_queued_request_that_leaves_frees_its_place() -> None:
    s = sched(1, max_queued=2)
    a = admitted(s.arrive("m", "a", 1, 0.0))
    gone, stays = queued(s.arrive("m", "b", 1, 0.0)), queued(s.arrive("m", "c", 1, 0.0))
    assert s.leave(gone, 1.0) == []
    assert s.snapshot(1.0)[0].queued == 1 and s.snapshot(1.0)[0].keys_waiting == 1
    assert s.finish(a, 2.0) == [stays]
    assert s.leave(stays, 3.0) == []  # admitted already: not in the queue
    # A big request at the head that leaves lets the ones behind it in.
    t = sched(2)
    one = admitted(t.arrive("m", "a", 1, 0.0))
    pair = queued(t.arrive("m", "b", 2, 0.0))
    small = queued(t.arrive("m", "c", 1, 0.0))
    assert t.leave(pair, 1.0) == [small]
    assert one.done == 0


def test_more_capacity_releases_queued_requests() -> None:
    s = sched(1)
    admitted(s.arrive("m", "a", 1, 0.0))
    waiting = [queued(s.arrive("m", "a", 1, 0.0)) for _ in range(3)]
    assert s.resize("m", 3, 1.0) == waiting[:2]
    assert s.resize("m", 0, 1.0) == []  # found serving: at least one slot
    assert s.snapshot(1.0)[0].capacity == 1


def test_retry_after_follows_recent_task_durations() -> None:
    assert retry_after_s(None, 1) == 1
    assert retry_after_s(0.2, 1) == 1
    assert retry_after_s(9.5, 2) == 5
    assert retry_after_s(1e6, 1) == 60
    s = sched(1, max_queued=0)
    a = admitted(s.arrive("m", "a", 1, 0.0))
    s.finish(a, 10.0)
    b = admitted(s.arrive("m", "a", 1, 10.0))
    s.finish(b, 15.0)  # mean 10 + 0.2 * (5 - 10) = 9
    admitted(s.arrive("m", "a", 1, 15.0))
    refused = s.arrive("m", "a", 1, 15.0)
    assert isinstance(refused, Refusal) and refused.retry_after_s == 9
    assert s.snapshot(15.0)[0].mean_task_s == 9.0


def test_keys_are_grouped_by_a_digest_never_kept_as_given() -> None:
    assert given_key("Bearer sk-1", None) == "sk-1" == given_key(None, " sk-1 ")
    assert given_key("Basic abc", "sk-2") == "sk-2"
    assert group_of("") == "" and group_of("sk-1") == group_of("sk-1") != group_of("sk-2")
    assert "sk-1" not in group_of("sk-1")


def test_capacity_is_the_slots_of_serving_heads_of_placed_instances() -> None:
    state = ClusterState()
    instances: list[tuple[str, InstanceStatus, InstanceRole]] = [
        ("i1", "placed", "chat"),
        ("i2", "placed", "chat"),
        ("i3", "rejected", "chat"),
        ("e", "placed", "embed"),
    ]
    for iid, status, role in instances:
        state.commit([Put(InstanceRow(instance_id=iid, model_id="m", status=status, role=role))])
    runners: list[tuple[str, str, int, RunnerState, int | None]] = [
        ("r1", "i1", 0, "Running", 4),
        ("r2", "i1", 0, "Ready", None),
        ("r3", "i1", 1, "Ready", 8),
        ("r4", "i2", 0, "Loading", 4),
        ("r5", "i3", 0, "Ready", 4),
        ("r6", "e", 0, "Ready", 4),
    ]
    for rid, iid, rank, runner_state, slots in runners:
        state.commit(
            [
                Put(
                    RunnerRow(
                        runner_id=rid,
                        instance_id=iid,
                        node_id="n",
                        device="cpu",
                        state=runner_state,
                        rank=rank,
                        slots=slots,
                    )
                )
            ]
        )
    # r1's 4 and r2's 1 (no count: 1); not a later stage, a loading head, a rejected
    # instance's, nor the embed instance's.
    assert serving_slots(state, "m") == 5
    assert serving_slots(state, "m", "embed") == 4
    assert serving_slots(state, "other") == 0


def test_the_slots_found_are_remembered_with_the_verdict() -> None:
    verdicts = ServingVerdicts(1.0, lambda: 5.0)
    assert verdicts.slots("m") is None  # never asked: read the projection
    verdicts.found("m", "chat", 8)
    assert verdicts.slots("m") == 8 and verdicts.slots("m", "embed") is None
    assert ServingVerdicts(0.0).slots("m") is None


def test_shoal_state_goes_on_without_an_api() -> None:
    assert read_admission(f"http://127.0.0.1:{free_port('127.0.0.1')}", None, 1.0) is None


def test_a_full_queue_is_a_429_in_each_dialect() -> None:
    err = queue_full(Refusal("m", capacity=1, queued=1, max_queued=1, retry_after_s=3))
    openai = error_response(err, "openai")
    assert openai.status_code == 429 and openai.headers["retry-after"] == "3"
    body = json.loads(bytes(openai.body))["error"]
    assert (body["type"], body["code"], body["param"]) == ("requests", "rate_limit_exceeded", None)
    assert "model `m` is busy" in body["message"] and "try again in 3 s" in body["message"]
    anthropic = error_response(err, "anthropic")
    assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "3"
    assert json.loads(bytes(anthropic.body))["error"]["type"] == "overloaded_error"
    ollama = error_response(err, "ollama")
    assert ollama.status_code == 429 and ollama.headers["retry-after"] == "3"
    assert json.loads(bytes(ollama.body)) == {"error": err.message}
    # Other statuses keep their types.
    other = json.loads(bytes(error_response(ApiError(503, "x"), "anthropic").body))
    assert other["error"]["type"] == "overloaded_error"


# --- the waiting ----------------------------------------------------------------------------


class Client:
    """The ASGI ``receive`` of a request whose body was read: it says ``http.disconnect``
    when the client goes away."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_a_queued_request_waits_for_a_slot_then_runs() -> None:
    adm = Admission(max_queued=1)
    first = await adm.enter("m", 1, 1, NOBODY, 10)
    waiting = asyncio.create_task(adm.enter("m", 1, 1, Caller("b", Client().receive), 10))
    await asyncio.sleep(0.01)
    assert not waiting.done() and adm.snapshot()[0].queued == 1
    with pytest.raises(ApiError) as refused:
        await adm.enter("m", 1, 1, Caller("c"), 10)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    first.task_done()
    second = await asyncio.wait_for(waiting, 1)
    assert second.ticket.group == "b" and adm.snapshot()[0].in_flight == 1
    second.close()
    assert adm.snapshot()[0].in_flight == 0


async def test_a_queued_request_whose_client_goes_away_leaves_the_queue() -> None:
    adm = Admission()
    first = await adm.enter("m", 1, 1, NOBODY, 10)
    client = Client()
    waiting = asyncio.create_task(adm.enter("m", 1, 1, Caller("b", client.receive), 10))
    cancelled = asyncio.create_task(adm.enter("m", 1, 1, Caller("c"), 10))
    await asyncio.sleep(0.01)
    assert adm.snapshot()[0].queued == 2
    client.gone.set()
    with pytest.raises(ApiError) as gone:
        await asyncio.wait_for(waiting, 1)
    assert gone.value.status == 499
    cancelled.cancel()  # the server cancels a request's task
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    snap = adm.snapshot()[0]
    assert (snap.queued, snap.in_flight) == (0, 1)
    first.task_done()
    assert adm.snapshot()[0].in_flight == 0


async def test_a_wait_past_the_timeout_is_a_504_and_a_background_one_is_unbounded() -> None:
    adm = Admission(max_queued=0)
    first = await adm.enter("m", 1, 1, NOBODY, 10)
    with pytest.raises(ApiError) as refused:
        await adm.enter("m", 1, 1, NOBODY, 10)
    assert refused.value.status == 429
    assert adm.refusal("m", 1, 1) is not None
    # Answered already (a background response): it waits whatever the bound.
    later = asyncio.create_task(adm.enter("m", 1, 1, Caller("", background=True), 0.05))
    with pytest.raises(ApiError) as late:
        await later
    assert late.value.status == 504 and adm.snapshot()[0].queued == 0
    first.task_done()
    assert adm.refusal("m", 1, 1) is None


# --- through a real `shoal up` --------------------------------------------------------------

# SmolLM2's <|endoftext|>, <|im_start|> and <|im_end|> banned: an answer runs to max_tokens.
ENDLESS = {"0": -100, "1": -100, "2": -100}
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
HI: list[MessageParam] = [{"role": "user", "content": "Hi"}]


async def _admission(client: httpx.AsyncClient) -> dict[str, Any]:
    models = (await client.get("/v1/admission")).json()["models"]
    return next(m for m in models if m["model"] == MODEL)


async def _until(client: httpx.AsyncClient, what: Callable[[dict[str, Any]], bool]) -> None:
    async with asyncio.timeout(60):
        while not what(await _admission(client)):
            await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_past_the_queue_every_dialect_gets_a_429_with_retry_after(
    up_cluster: UpCluster,
) -> None:
    """A second API process with room for one queued request: with every slot taken (long
    streamed answers) and one request queued, the next gets a 429 at once (the openai and
    anthropic SDKs raise their RateLimitError); a client that leaves frees its slot, and the
    queued request is answered."""
    port = free_port("127.0.0.1")
    proc = start(
        [
            SHOAL,
            "api",
            "--nats",
            up_cluster.nats_url,
            "--db",
            up_cluster.db_url,
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--max-queued",
            "1",
        ]
    )
    drained = Drained(proc)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        await wait_healthy(url)
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            await sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
            first = await _admission(client)
            capacity = first["capacity"]  # the runners' slots
            assert capacity >= 1 and first["in_flight"] == 0  # its slot freed as it finished

            # Every slot taken by answers that would run long, read as they come.
            holders = [
                await sdk.chat.completions.create(
                    model=MODEL,
                    messages=HELLO,
                    max_tokens=1000,
                    temperature=0,
                    logit_bias=ENDLESS,
                    stream=True,
                )
                for _ in range(capacity)
            ]
            streamed = [0] * capacity

            async def read(i: int) -> None:
                async for _ in holders[i]:
                    streamed[i] += 1

            readers = [asyncio.create_task(read(i)) for i in range(capacity)]
            await _until(client, lambda m: m["in_flight"] == capacity)
            # A queued request whose client goes away leaves the queue.
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    "/v1/chat/completions", timeout=0.5, json={"model": MODEL, "messages": HELLO}
                )
            await _until(client, lambda m: m["queued"] == 0)
            waiting = asyncio.create_task(
                sdk.chat.completions.create(
                    model=MODEL, messages=HELLO, max_tokens=4, logit_bias=ENDLESS
                )
            )
            await _until(client, lambda m: m["queued"] == 1)

            # The queue is full: a 429 at once, whole or streamed, in each dialect's shape.
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError) as refused:
                await sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
            assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
            assert int(refused.value.response.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                await sdk.chat.completions.create(
                    model=MODEL, messages=HELLO, max_tokens=4, stream=True
                )
            with pytest.raises(anthropic.RateLimitError) as overloaded:
                await claude.messages.create(model=MODEL, max_tokens=4, messages=HI)
            assert overloaded.value.status_code == 429
            assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            assert "retry-after" in overloaded.value.response.headers
            ollama = await client.post("/api/chat", json={"model": MODEL, "messages": HELLO})
            assert ollama.status_code == 429 and "is busy" in ollama.json()["error"]
            assert time.monotonic() - started < 5  # answered at once, not after a wait

            # A client that leaves frees its slot: the queued request runs, and is answered.
            await holders[0].close()
            answer = await asyncio.wait_for(waiting, 60)
            assert answer.choices[0].message.content
            assert answer.choices[0].finish_reason == "length"
            assert all(streamed), streamed  # the others were being answered all along
            for holder in holders[1:]:
                await holder.close()
            await asyncio.gather(*readers, return_exceptions=True)
            await _until(client, lambda m: m["in_flight"] == 0 and m["queued"] == 0)
            snap = await _admission(client)
            assert snap["rejected"] == 4 and snap["max_queued"] == 1
            scrape = (await client.get("/metrics")).text
            assert f'shoal_admission_rejected_total{{model="{MODEL}"}} 4.0' in scrape
            assert f'shoal_admission_capacity{{model="{MODEL}"}} {capacity}.0' in scrape
            assert f'shoal_admission_wait_seconds_count{{model="{MODEL}"}}' in scrape

        shown = await asyncio.to_thread(
            subprocess.run,
            [
                SHOAL,
                "state",
                "--db",
                up_cluster.db_url,
                "--api",
                url,
                "--api-key",
                KEY,
                "--tasks",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ | {"COLUMNS": "200"},
        )
        assert shown.returncode == 0, shown.stderr
        assert f"admission ({url}, api@" in shown.stdout, shown.stdout
    finally:
        drained.stop()

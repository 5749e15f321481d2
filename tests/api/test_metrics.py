"""GET /metrics: the pure parts on their own, then a real API, projector and nats-server.

Tokens and time to first token need a runner: tests/cli/test_up.py checks them against
`shoal up` with SmolLM2.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.cluster_metrics import (
    ConsumerBacklog,
    LogReading,
    ProjectionReading,
    cluster_families,
    dead_letters_by_stream,
)
from api.metrics import ApiMetrics, HttpMetrics, _Families, endpoint_of, token_timing
from bus.publisher import Publisher
from events.catalogue import (
    EVENT_TYPES,
    InstancePlaced,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    RunnerStateChanged,
    event_type_filters,
)
from events.records import NodeProfile, ShardAssignment
from events.states import NodeStatus, RunnerState
from events.units import MiB
from harness.processes import wait_healthy
from projectors.rows import DeviceRow, NodeRow, RunnerRow
from tests.api.conftest import ApiStack

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape by (name, labels); parsing also checks the format."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def with_name(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


# --- pure parts ----------------------------------------------------------------------------


def _labelled_app(tmp_path: Path) -> tuple[FastAPI, ApiMetrics]:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @router.get("/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    @router.get("/broken")
    async def broken() -> None:
        raise RuntimeError("a bug")

    app.include_router(router)
    (tmp_path / "a.txt").write_text("a")
    app.mount("/files", StaticFiles(directory=tmp_path))
    m = ApiMetrics()
    app.add_middleware(HttpMetrics, metrics=m)
    return app, m


async def test_requests_are_labelled_by_route_template_not_path(tmp_path: Path) -> None:
    app, m = _labelled_app(tmp_path)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for path in ("/v1/things/1", "/v1/things/2", "/files/a.txt"):
            assert (await client.get(path)).status_code == 200
        assert (await client.put("/v1/things/1")).status_code == 405
        assert (await client.get("/files/missing.txt")).status_code == 404
        assert (await client.get("/wp-admin/setup.php")).status_code == 404
        assert (await client.get("/v1/broken")).status_code == 500
    s = parse(generate_latest(m.registry).decode())
    requests = {
        (dict(k)["method"], dict(k)["endpoint"], dict(k)["status"]): v
        for k, v in with_name(s, "shoal_http_requests_total").items()
    }
    assert requests == {
        ("GET", "/v1/things/{thing_id}", "200"): 2,
        ("PUT", "/v1/things/{thing_id}", "405"): 1,
        ("GET", "/files/{path}", "200"): 1,
        ("GET", "/files/{path}", "404"): 1,
        ("GET", "other", "404"): 1,
        ("GET", "/v1/broken", "500"): 1,
    }
    errors = with_name(s, "shoal_http_request_errors_total")
    assert sum(errors.values()) == 4


def test_endpoint_of_a_scope() -> None:
    class Route:
        path_format = "/v1/instances/{instance_id}"

    assert endpoint_of({"route": Route(), "root_path": ""}, "") == "/v1/instances/{instance_id}"
    assert endpoint_of({"root_path": "/api/static"}, "/api") == "/static/{path}"
    assert endpoint_of({"root_path": "/api"}, "/api") == "other"
    assert endpoint_of({}, "") == "other"


def test_method_and_status_labels_stay_bounded() -> None:
    m = ApiMetrics()
    m.request("BREW", "other", 418)
    m.request("GET", "/v1/models", 200)
    s = parse(generate_latest(m.registry).decode())
    labels = {"endpoint": "other", "status": "418", "method": "other"}
    assert value(s, "shoal_http_requests_total", **labels) == 1
    assert value(s, "shoal_http_request_errors_total", **labels) == 1
    assert (
        value(s, "shoal_http_requests_total", method="GET", endpoint="/v1/models", status="200")
        == 1
    )
    assert not with_name(s, "shoal_http_request_errors_total").keys() - {frozenset(labels.items())}


def test_token_timing() -> None:
    assert token_timing(11, 100.0, 100.5, 102.5) == (0.5, 5.0)  # 10 tokens after the first in 2s
    assert token_timing(1, 100.0, 100.5, 100.5) == (0.5, None)  # one token: no rate
    assert token_timing(0, 100.0, None, None) == (None, None)
    assert token_timing(3, None, 1.0, 2.0) == (None, None)  # never started


def _matches(subject: str, pattern: str) -> bool:
    s, p = subject.split("."), pattern.split(".")
    return len(s) == len(p) and all(b in ("*", a) for a, b in zip(s, p, strict=True))


def test_each_event_type_has_a_filter_matching_only_its_subjects() -> None:
    filters = event_type_filters()
    assert filters["TaskCreated"] == "shoal.events.task.*.*.TaskCreated"
    assert filters["NodeJoined"] == "shoal.events.node.*.NodeJoined"
    on_chunks = {
        "ChunkGenerated",
        "PromptScored",
        "EmbeddingsComputed",
        "ImageStepped",
        "ImageGenerated",
    }
    assert not on_chunks & set(filters)
    assert len(filters) == len(EVENT_TYPES) - len(on_chunks)
    subjects = {
        "TaskCreated": "shoal.events.task.Qwen2%2E5.t1.TaskCreated",
        "NodeJoined": "shoal.events.node.n1.NodeJoined",
        "RunnerStateChanged": "shoal.events.runner.r1.RunnerStateChanged",
    }
    for kind, subject in subjects.items():
        assert [k for k, f in filters.items() if _matches(subject, f)] == [kind]


def test_dead_letters_are_counted_by_the_stream_they_came_from() -> None:
    subjects = {"shoal.deadletter.SHOAL_EVENTS": 3, "shoal.deadletter.SHOAL_CHUNKS": 1}
    assert dead_letters_by_stream(subjects) == {"SHOAL_EVENTS": 3, "SHOAL_CHUNKS": 1}
    assert dead_letters_by_stream({"elsewhere.x": 5}) == {}


def _node(node_id: str, status: NodeStatus) -> NodeRow:
    return NodeRow(
        node_id=node_id,
        status=status,
        ram_total=8 * MiB,
        ram_available=5 * MiB,
        memory_offered=4 * MiB,
        cpu_load=12.5,
    )


def _runner(runner_id: str, state: RunnerState) -> RunnerRow:
    return RunnerRow(runner_id=runner_id, instance_id="i", node_id="n1", device="cpu", state=state)


def test_cluster_families_from_readings() -> None:
    events = LogReading(
        last_seq={"SHOAL_EVENTS": 120, "SHOAL_CHUNKS": 900, "SHOAL_DEADLETTER": 2},
        messages={"SHOAL_EVENTS": 120, "SHOAL_CHUNKS": 800, "SHOAL_DEADLETTER": 2},
        dead_letters={"SHOAL_EVENTS": 2},
        consumers=[ConsumerBacklog("SHOAL_EVENTS", "tasks-m", 4, 1)],
        unapplied_by_type={"NodeJoined": 1},
    )
    projection = ProjectionReading(
        applied_seq={"main": 100},
        nodes=[_node("n1", "online"), _node("gone", "left")],
        devices=[
            DeviceRow(
                node_id="n1", device="gpu0", kind="gpu", memory_total=16 * MiB, memory_used=2 * MiB
            ),
            DeviceRow(node_id="n1", device="cpu", kind="cpu", memory_total=8 * MiB),
        ],
        runners=[_runner("a", "Ready"), _runner("b", "Ready"), _runner("c", "Loading")],
        resumes=3,
        events_by_type={"NodeJoined": 1, "TaskCreated": 0, "LogTailLost": 1},
    )
    s = parse(generate_latest(_Families(cluster_families(events, projection))).decode())
    assert value(s, "shoal_log_tail_lost_total") == 1
    assert value(s, "shoal_metrics_source_up", source="nats") == 1
    assert value(s, "shoal_projector_lag_events", projector="main") == 20
    assert value(s, "shoal_projector_applied_seq", projector="main") == 100
    assert value(s, "shoal_events_in_log", type="NodeJoined") == 2
    assert value(s, "shoal_events_consumed", consumer="projector:main", type="NodeJoined") == 1
    assert value(s, "shoal_events_consumed", consumer="projector:main", type="TaskCreated") == 0
    assert value(s, "shoal_dead_letters", stream="SHOAL_EVENTS") == 2
    assert value(s, "shoal_dead_letters", stream="SHOAL_CHUNKS") is None  # none came from it
    assert value(s, "shoal_consumer_pending_events", stream="SHOAL_EVENTS", consumer="tasks-m") == 4
    runners = {dict(k)["state"]: v for k, v in with_name(s, "shoal_runners").items()}
    assert runners == {
        "Assigned": 0,
        "Downloading": 0,
        "Loading": 1,
        "Ready": 2,
        "Running": 0,
        "Failed": 0,
        "Stopped": 0,
    }
    assert value(s, "shoal_nodes", status="left") == 1
    assert value(s, "shoal_task_resumes_total") == 3
    memory = with_name(s, "shoal_node_memory_bytes")
    assert {dict(k)["node"] for k in memory} == {"n1"}  # a node that left has no current profile
    assert value(s, "shoal_node_memory_bytes", node="n1", kind="offered") == 4 * MiB
    assert value(s, "shoal_node_cpu_load_percent", node="n1") == 12.5
    gpu = with_name(s, "shoal_device_memory_bytes")
    assert {(dict(k)["device"], dict(k)["kind"]): v for k, v in gpu.items()} == {
        ("gpu0", "total"): 16 * MiB,
        ("gpu0", "used"): 2 * MiB,
    }

    # A source that cannot be read is left out, and says so.
    s = parse(generate_latest(_Families(cluster_families(None, projection))).decode())
    assert value(s, "shoal_metrics_source_up", source="nats") == 0
    assert value(s, "shoal_runners", state="Ready") == 2
    assert not with_name(s, "shoal_projector_lag_events")
    assert not with_name(s, "shoal_events_in_log")


# --- against real processes ------------------------------------------------------------------


async def _scrape(client: httpx.AsyncClient) -> Samples:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(r.text)


async def _until(
    client: httpx.AsyncClient, check: Callable[[Samples], bool], timeout: float = 20
) -> Samples:
    async with asyncio.timeout(timeout):
        while not check(s := await _scrape(client)):
            await asyncio.sleep(0.1)
    return s


async def _cluster(js: JetStreamContext) -> None:
    """A node, a model, and one runner of a placed instance that is Ready, as a worker, the
    planner and the runner would announce them."""
    pub = Publisher(js)
    await pub.publish(NodeJoined(node_id="n1", origin="n1", heartbeat_s=3600))
    profile = NodeProfile(
        ram_total=4096 * MiB,
        ram_available=3000 * MiB,
        cpu_count=2,
        memory_offered=2048 * MiB,
        cpu_load=37.5,
    )
    await pub.publish(ResourceProfiled(node_id="n1", origin="n1", profile=profile))
    await pub.publish(
        ModelAdded(
            model_id="m", origin="test", n_layers=10, size_bytes=100 * MiB, context_length=4096
        )
    )
    shard = ShardAssignment(runner_id="r1", node_id="n1", start_layer=0, end_layer=10, n_layers=10)
    await pub.publish(
        InstancePlaced(instance_id="i1", model_id="m", shards=[shard], origin="planner")
    )
    await pub.publish(
        RunnerStateChanged(
            runner_id="r1", instance_id="i1", node_id="n1", state="Ready", origin="n1"
        )
    )


def _http(samples: Samples, name: str, method: str, endpoint: str, status: int) -> float:
    labels = {"method": method, "endpoint": endpoint, "status": str(status)}
    return value(samples, name, **labels) or 0


@pytest.mark.slow
async def test_requests_errors_and_published_events_are_counted(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    await _cluster(js)
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        await _until(client, lambda s: value(s, "shoal_runners", state="Ready") == 1)
        for _ in range(2):
            assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/v1/instances/i1")).status_code == 200
        assert (await client.get("/v1/instances/nope")).status_code == 404
        assert (await client.get("/no/such/page")).status_code == 404
        assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 400
        created = await client.post("/v1/instances", json={"model": "m", "queue": True})
        assert created.status_code == 202

        s = await _scrape(client)
        assert _http(s, "shoal_http_requests_total", "GET", "/v1/models", 200) == 2
        path = "/v1/instances/{instance_id}"
        assert _http(s, "shoal_http_requests_total", "GET", path, 200) == 1
        assert _http(s, "shoal_http_request_errors_total", "GET", path, 200) == 0
        assert _http(s, "shoal_http_request_errors_total", "GET", path, 404) == 1
        assert _http(s, "shoal_http_request_errors_total", "GET", "other", 404) == 1
        errs = _http(s, "shoal_http_request_errors_total", "POST", "/v1/chat/completions", 400)
        assert errs == 1
        assert value(s, "shoal_events_published_total", type="InstanceRequested") == 1
        endpoints = {dict(k)["endpoint"] for k in with_name(s, "shoal_http_requests_total")}
        assert not {"/v1/instances/i1", "/v1/instances/nope", "/no/such/page"} & endpoints

        # A chat the projection says r1 can serve: the API publishes its task; nobody pulls
        # it, r1 stops, and the API gives up with a 503 and cancels the task.
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        asked = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
        await asyncio.sleep(0.5)
        await Publisher(js).publish(
            RunnerStateChanged(
                runner_id="r1", instance_id="i1", node_id="n1", state="Stopped", origin="n1"
            )
        )
        assert (await asyncio.wait_for(asked, 15)).status_code == 503
        s = await _until(
            client, lambda s: value(s, "shoal_events_published_total", type="TaskCancelled") == 1
        )
        assert value(s, "shoal_events_published_total", type="TaskCreated") == 1
        assert _http(s, "shoal_http_request_errors_total", "POST", "/v1/chat/completions", 503) == 1
        assert not with_name(s, "shoal_tokens_generated_total")  # nothing was generated


@pytest.mark.slow
async def test_streamed_responses_still_stream_through_the_counting(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    """The live event feed sends its first line at once and each event as it is published:
    were the middleware to buffer, nothing would arrive before the stream ends."""
    async with (
        httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client,
        client.stream("GET", "/v1/events", params={"subject": "shoal.events.node.>"}) as resp,
    ):
        lines = resp.aiter_lines()
        async with asyncio.timeout(10):
            assert (await anext(lines)).startswith(":")
        for node in ("a", "b"):
            published = time.monotonic()
            await Publisher(js).publish(NodeJoined(node_id=node, origin=node))
            async with asyncio.timeout(10):
                while not (line := await anext(lines)).startswith("data: "):
                    pass
            assert f'"node_id":"{node}"' in line
            assert time.monotonic() - published < 5


@pytest.mark.slow
async def test_cluster_values_follow_the_log_and_the_projection(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    await _cluster(js)
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        s = await _until(
            client,
            lambda s: (
                value(s, "shoal_runners", state="Ready") == 1
                and value(s, "shoal_projector_lag_events", projector="main") == 0
            ),
        )
        runners = {dict(k)["state"]: v for k, v in with_name(s, "shoal_runners").items()}
        assert runners == {
            "Assigned": 0,
            "Downloading": 0,
            "Loading": 0,
            "Ready": 1,
            "Running": 0,
            "Failed": 0,
            "Stopped": 0,
        }
        assert value(s, "shoal_nodes", status="online") == 1
        memory = {dict(k)["kind"]: v for k, v in with_name(s, "shoal_node_memory_bytes").items()}
        assert memory == {"total": 4096 * MiB, "available": 3000 * MiB, "offered": 2048 * MiB}
        assert value(s, "shoal_node_cpu_load_percent", node="n1") == 37.5
        in_log = {dict(k)["type"]: v for k, v in with_name(s, "shoal_events_in_log").items()}
        assert in_log["NodeJoined"] == 1 and in_log["RunnerStateChanged"] == 1
        assert in_log["TaskCreated"] == 0 and sum(in_log.values()) == 5
        last = value(s, "shoal_stream_last_seq", stream="SHOAL_EVENTS")
        assert last == 5 and value(s, "shoal_projector_applied_seq", projector="main") == 5
        assert value(s, "shoal_dead_letters", stream="SHOAL_EVENTS") == 0
        assert value(s, "shoal_metrics_source_up", source="database") == 1
        # The projector's durable consumer, caught up; the counting consumers are not listed.
        consumers = with_name(s, "shoal_consumer_pending_events")
        assert {dict(k)["consumer"] for k in consumers} == {"projector-main"}

        # A malformed event: the projector sets it aside; the log still holds it.
        await js.publish("shoal.events.node.bad.NodeJoined", b"this is { not json")
        s = await _until(
            client, lambda s: value(s, "shoal_dead_letters", stream="SHOAL_EVENTS") == 1
        )
        assert value(s, "shoal_events_in_log", type="NodeJoined") == 2
        s = await _until(
            client, lambda s: value(s, "shoal_projector_lag_events", projector="main") == 0
        )

        # With the projector stopped, what is published is lag.
        api_stack.procs.kill("projector")
        for node in ("x", "y", "z"):
            await Publisher(js).publish(NodeJoined(node_id=node, origin=node))
        s = await _scrape(client)
        assert value(s, "shoal_projector_lag_events", projector="main") == 3
        assert value(s, "shoal_events_in_log", type="NodeJoined") == 5
        assert value(s, "shoal_events_consumed", consumer="projector:main", type="NodeJoined") == 2
        assert value(s, "shoal_nodes", status="online") == 1  # the projection did not move


@pytest.mark.slow
async def test_metrics_need_the_key_when_keys_are_configured(api_stack: ApiStack) -> None:
    url = api_stack.start_api("api-keys", "--api-key", "sekrit-1")
    await wait_healthy(url)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await client.get("/metrics")).status_code == 401
        ok = await client.get("/metrics", headers={"Authorization": "Bearer sekrit-1"})
        assert ok.status_code == 200 and "shoal_runners" in ok.text
        # And it is not part of the API's schema.
        assert "/metrics" not in (await client.get("/openapi.json")).json()["paths"]


# JetStream API requests that change what the server holds.
_WRITES = (
    "CONSUMER.CREATE",
    "CONSUMER.DURABLE.CREATE",
    "CONSUMER.DELETE",
    "STREAM.CREATE",
    "STREAM.UPDATE",
    "STREAM.DELETE",
    "STREAM.PURGE",
    "STREAM.MSG.DELETE",
)


@pytest.mark.slow
async def test_a_scrape_only_reads_from_the_nats_server(
    api_stack: ApiStack, js: JetStreamContext, nc: Client
) -> None:
    """Counts by type come from the projection, and the few events past the projector's
    tracking row are read one by one: a scrape creates and deletes no consumer."""
    await _cluster(js)
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        await _until(
            client, lambda s: value(s, "shoal_projector_lag_events", projector="main") == 0
        )
        api_stack.procs.kill("projector")  # the projector's own pulls would mingle
        await Publisher(js).publish(NodeJoined(node_id="late", origin="late"))
        requests: list[str] = []

        async def seen(msg: Msg) -> None:
            requests.append(msg.subject)

        sub = await nc.subscribe("$JS.API.>", cb=seen)
        await nc.flush()
        s = await _scrape(client)
        await nc.flush()
        await sub.unsubscribe()
    assert value(s, "shoal_events_in_log", type="NodeJoined") == 2  # one read past the row
    assert value(s, "shoal_events_consumed", consumer="projector:main", type="NodeJoined") == 1
    assert any(r.startswith("$JS.API.STREAM.INFO.") for r in requests), requests
    assert any(r.startswith("$JS.API.STREAM.MSG.GET.") for r in requests), requests
    assert not [r for r in requests if r.removeprefix("$JS.API.").startswith(_WRITES)], requests

"""Bad input against the HTTP API: every refusal is a 4xx in its dialect's error shape (OpenAI's,
Anthropic's under /v1/messages, Ollama's under /api/), never a 5xx, a 422 or a hang.

Three parts:

- a property-based test generated from the API's own OpenAPI document with schemathesis
  (valid and invalid requests for every operation but the never-ending ``GET /v1/events``);
- hand-written bad requests, each expecting a 400 (or the 404 / 503 a request for a model
  that cannot answer gets) with a message and ``param`` that say what is wrong;
- the official ``openai`` SDK, which must raise its own error classes for those answers.

No model runs in these stacks. Most tests share one stack per module (nats-server, projector,
``shoal api``) that knows a model, ``tiny``, and a node, ``node-a`` (a CPU and one GPU), so that
requests reach placement; the two property-based tests share another (their requests create
instances), and the tests that break the cluster start their own.

The tests at the end pin what fuzzing found (each was a bug: a 5xx, a cut-off response, an
event that stopped the projector), so that it stays fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.core.result import Ok

from api import roles
from api.errors import Dialect, dialect_of
from api.keys import key_digest
from bus.connection import connect
from bus.publisher import Publisher
from events.catalogue import (
    EventBase,
    InstancePlaced,
    InstanceRequested,
    KeyAdded,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    ResponseStored,
    RunnerStateChanged,
    TaskCreated,
)
from events.records import ChatMessage, GpuInfo, NodeProfile, ShardAssignment
from events.units import GiB
from tests.api.conftest import ApiStack, running_api_stack
from tests.api.conftest import run_sync as _run_sync

T = TypeVar("T")
Case = schemathesis.Case[Any]
Operation = schemathesis.APIOperation[Any, Any, Any, Any]

KNOWN_MODEL = "tiny"  # known to the seeded stacks; context_length 0 (unknown), no runner
NODE = "node-a"
REQUEST_TIMEOUT_S = 10.0  # no request may take longer: beyond this it counts as a hang
# How long the projector gets to show an event (it takes < 1 s): long where the test must
# pass, short where it pins a bug (a slow projector then cannot make that test pass wrongly).
PROJECTION_WAIT_S = 30.0
PROJECTION_WAIT_BUG_S = 10.0
MAX_EXAMPLES = 15  # per operation and generation mode
MAX_SHOWN = 2000  # characters of a failing request shown (generated bodies can be huge)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}
# Two user keys (their ids are the keys themselves, for brevity) and what the first made.
OWNER_KEY, OTHER_KEY = "sk-owner-key", "sk-other-key"
OWNED_RESPONSE = "resp_owned"
SECRET = b"the-owners-secret-7f3a"


# --- the stacks -----------------------------------------------------------------------------


def _cluster_events(serving: bool) -> list[EventBase]:
    """A model and a node, as `shoal models add` and a worker announce them; with ``serving``,
    also an instance of the model placed on the node with a runner that says it is Ready
    (there is no such process: a chat request is taken, and never answered)."""
    profile = NodeProfile(
        ram_total=16 * GiB,
        ram_available=16 * GiB,
        cpu_count=4,
        memory_offered=8 * GiB,
        gpus=[GpuInfo(index=0, name="fake", memory_total=8 * GiB, memory_used=0)],
    )
    events: list[EventBase] = [
        ModelAdded(
            model_id=KNOWN_MODEL,
            origin="test",
            n_layers=4,
            size_bytes=10**6,
            kv_bytes_per_token=100,
        ),
        NodeJoined(node_id=NODE, origin=NODE, heartbeat_s=3600),
        ResourceProfiled(node_id=NODE, origin=NODE, profile=profile),
    ]
    if serving:
        instance, runner = "tiny-serving", "tiny-serving-r0"
        shard = ShardAssignment(
            runner_id=runner, node_id=NODE, start_layer=0, end_layer=4, n_layers=4
        )
        events += [
            InstanceRequested(instance_id=instance, model_id=KNOWN_MODEL, origin="test"),
            InstancePlaced(
                instance_id=instance, model_id=KNOWN_MODEL, origin="test", shards=[shard]
            ),
            RunnerStateChanged(
                runner_id=runner, instance_id=instance, node_id=NODE, state="Ready", origin=NODE
            ),
        ]
    return events


async def _eventually(
    url: str, probe: Callable[[httpx.AsyncClient], Awaitable[bool]], timeout: float
) -> bool:
    """Whether ``probe`` became true within ``timeout`` seconds."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await probe(client):
                return True
            await asyncio.sleep(0.1)
    return False


async def _seed(stack: ApiStack, serving: bool = False) -> None:
    nc = await connect(stack.nats_url, name="test-fuzz")
    try:
        pub = Publisher(nc.jetstream())
        for event in _cluster_events(serving):
            await pub.publish(event)
    finally:
        await nc.close()

    async def projected(client: httpx.AsyncClient) -> bool:
        spec = {"chat": {"devices": [f"{NODE}:gpu0"]}}
        r = await client.post(
            "/v1/placement/preview", json={"model": KNOWN_MODEL, "placement": spec}
        )
        if r.status_code != 200 or not r.json()["placeable"]:
            return False
        if not serving:
            return True
        shards = (await client.get("/v1/instances/tiny-serving")).json().get("shards", [])
        return [s["state"] for s in shards] == ["Ready"]

    assert await _eventually(stack.url, projected, timeout=30), "the seed events never showed"


async def _projection_alive(stack: ApiStack, probe_node: str, timeout: float) -> bool:
    """Whether the projector still applies events: a new node must show in /v1/state."""
    nc = await connect(stack.nats_url, name="test-fuzz-probe")
    try:
        await Publisher(nc.jetstream()).publish(NodeJoined(node_id=probe_node, origin="test"))
    finally:
        await nc.close()

    async def shown(client: httpx.AsyncClient) -> bool:
        nodes = (await client.get("/v1/state", params={"tasks": 0})).json()["nodes"]
        return probe_node in {n["node_id"] for n in nodes}

    return await _eventually(stack.url, shown, timeout)


@contextlib.contextmanager
def _running_stack(root: Path) -> Iterator[ApiStack]:
    """conftest's ``running_api_stack``, seeded with ``tiny`` and ``node-a``."""
    with running_api_stack(root) as stack:
        _run_sync(_seed(stack))
        yield stack


@pytest.fixture(scope="module")
def seeded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiStack]:
    """One stack for the module's request-and-answer tests (none of them changes it)."""
    with _running_stack(tmp_path_factory.mktemp("fuzz-stack")) as stack:
        yield stack


@pytest.fixture(scope="module")
def fuzzed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiStack]:
    """One stack for the two property-based tests, which dirty it (generated requests create
    instances): the fuzz without a key first, then the fuzz as a user key, which adds keys
    (from then on a request without one is refused)."""
    with _running_stack(tmp_path_factory.mktemp("fuzzed-stack")) as stack:
        yield stack


@pytest.fixture
async def client(seeded_stack: ApiStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=seeded_stack.url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


# --- each dialect's error shape -------------------------------------------------------------


def _shape_problems(
    status: int, content: bytes, content_type: str, dialect: Dialect = "openai"
) -> list[str]:
    """What is wrong with an error response, given its dialect's shape: OpenAI's
    ``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``,
    Anthropic's ``{"type": "error", "error": {"type": str, "message": str}}``, Ollama's
    ``{"error": str}``."""
    if not content_type.startswith("application/json"):
        return [f"content-type is {content_type!r}, not JSON"]
    try:
        body = json.loads(content)
    except ValueError:
        return [f"body is not JSON: {content[:200]!r}"]
    problems = []
    if status == 422:
        problems.append("422: FastAPI's status, where every dialect (and this API) answers 400")
    if dialect == "ollama":
        if not isinstance(body, dict) or set(body) != {"error"} or not body["error"]:
            return [*problems, f"body is not {{'error': '...'}}: {content[:300]!r}"]
        if not isinstance(body["error"], str):
            problems.append(f"error is {body['error']!r}, not a string")
        return problems
    if dialect == "anthropic":
        if (
            not isinstance(body, dict)
            or body.get("type") != "error"
            or set(body) != {"type", "error"}
            or not isinstance(body["error"], dict)
        ):
            return [
                *problems,
                f"body is not {{'type': 'error', 'error': {{...}}}}: {content[:300]!r}",
            ]
        err = body["error"]
        if set(err) != {"type", "message"}:
            problems.append(f"error keys are {sorted(err)}, not ['message', 'type']")
        for key in ("type", "message"):
            if not isinstance(err.get(key), str) or not err.get(key):
                problems.append(f"{key} is {err.get(key)!r}, not a non-empty string")
        return problems
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [*problems, f"body is not {{'error': {{...}}}}: {content[:300]!r}"]
    err = body["error"]
    if set(err) != ERROR_KEYS:
        problems.append(f"error keys are {sorted(err)}, not {sorted(ERROR_KEYS)}")
    if not isinstance(err.get("message"), str) or not err.get("message"):
        problems.append(f"message is {err.get('message')!r}, not a non-empty string")
    if not isinstance(err.get("type"), str) or not err.get("type"):
        problems.append(f"type is {err.get('type')!r}, not a non-empty string")
    for key in ("param", "code"):
        if err.get(key) is not None and not isinstance(err[key], str):
            problems.append(f"{key} is {err[key]!r}, neither a string nor null")
    return problems


def _error(r: httpx.Response, status: int | set[int]) -> dict[str, Any]:
    """The ``error`` object of ``r``, after checking its status and shape."""
    expected = {status} if isinstance(status, int) else status
    assert r.status_code in expected, f"{r.status_code}: {r.text[:500]}"
    problems = _shape_problems(r.status_code, r.content, r.headers.get("content-type", ""))
    assert not problems, f"{problems}: {r.text[:500]}"
    err: dict[str, Any] = r.json()["error"]
    return err


# --- 1. property-based, from the OpenAPI document -------------------------------------------


def _with_known_model(drawn: tuple[Case, bool]) -> Case:
    """Half the valid bodies name the model the cluster knows, so that requests get past the
    404 into placement (preview, instances) and the 503 of a model with no runner (chat)."""
    case, known = drawn
    if known and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = KNOWN_MODEL
    if known and case.path_parameters and "response_id" in case.path_parameters:
        case.path_parameters["response_id"] = OWNED_RESPONSE  # one key's, asked by another
    if known and isinstance(case.body, dict) and "previous_response_id" in case.body:
        case.body["previous_response_id"] = OWNED_RESPONSE
    return case


@dataclass(frozen=True)
class Caller:
    """Who the fuzz calls as: the headers it sends, and text it must never be shown (another
    key's objects) nor be let through to (admin routes, for a user key)."""

    headers: dict[str, str] = field(default_factory=dict)
    secret: bytes | None = None
    user: bool = False


NOBODY = Caller()


def _call_problems(
    case: Case, url: str, session: requests.Session, caller: Caller = NOBODY
) -> list[str]:
    try:
        response = case.call(
            base_url=url, session=session, headers=caller.headers, timeout=REQUEST_TIMEOUT_S
        )
    except requests.Timeout:
        return [f"no answer within {REQUEST_TIMEOUT_S:g} s (a hang)"]
    except requests.RequestException as exc:
        return [f"no answer: {exc!r}"]
    status = response.status_code
    problems = []
    if caller.secret is not None and caller.secret in response.content:
        problems.append(f"{status}: shows another key's object")
    if caller.user and status < 400 and roles.needed(case.method.upper(), case.path) == "admin":
        problems.append(f"{status}: an admin route let a user key through")
    if status >= 500 and not _model_not_ready(status, response.content):
        problems.append(f"server error {status}: {response.content[:300]!r}")
    if response.elapsed > REQUEST_TIMEOUT_S:
        problems.append(f"took {response.elapsed:.1f} s")
    if status >= 400:
        content_type = next(
            (v[0] for k, v in response.headers.items() if k.lower() == "content-type" and v), ""
        )
        problems += _shape_problems(status, response.content, content_type, dialect_of(case.path))
    return problems


def _model_not_ready(status: int, content: bytes) -> bool:
    """The one 5xx expected here: the known model has no runner (503 model_not_ready, in
    whichever dialect)."""
    try:
        error = json.loads(content)["error"]
    except (ValueError, TypeError, KeyError):
        return False
    if isinstance(error, dict) and "code" in error:
        return status == 503 and error["code"] == "model_not_ready"
    message = error.get("message") if isinstance(error, dict) else error
    return status == 503 and isinstance(message, str) and "cannot answer now" in message


@dataclass(frozen=True)
class Fuzzed:
    """The requests generated for one operation in one generation mode."""

    operation: Operation
    mode: schemathesis.GenerationMode
    cases: list[Case]


def _generate(
    operation: Operation, mode: schemathesis.GenerationMode, examples: int = MAX_EXAMPLES
) -> Fuzzed:
    """Up to ``examples`` requests, drawn once and sent by each test that fuzzes (drawing costs
    more than sending: a tenth of a second a request for the larger bodies, such as Anthropic's
    messages). Nothing is raised while drawing, so none is shrunk (which would cost many more
    requests, each up to the timeout when the problem is a hang)."""
    drawn: list[Case] = []
    cases = operation.as_strategy(generation_mode=mode)
    if mode is schemathesis.GenerationMode.POSITIVE:
        cases = st.tuples(cases, st.booleans()).map(_with_known_model)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def run(case: Case) -> None:
        drawn.append(case)

    try:
        run()
    except Unsatisfiable:
        # Nothing to make invalid: no parameters, or only a path parameter (any text is one).
        assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    return Fuzzed(operation, mode, drawn)


def _send(
    fuzzed: Fuzzed, url: str, session: requests.Session, caller: Caller = NOBODY
) -> list[str]:
    """Every problem the requests meet, each with the request as a curl command. Problems are
    collected, not raised, so that one run reports them all."""
    found: list[str] = []
    for case in fuzzed.cases:
        for problem in _call_problems(case, url, session, caller):
            curl = case.as_curl_command(base_url=url, headers=caller.headers)
            if len(curl) > MAX_SHOWN:
                curl = f"{curl[:MAX_SHOWN]}... ({len(curl)} characters)"
            found.append(f"{fuzzed.operation.label} ({fuzzed.mode.value}): {problem}\n    {curl}")
    return found


@pytest.fixture(scope="module")
def fuzz_cases(fuzzed_stack: ApiStack) -> list[Fuzzed]:
    """Valid and invalid requests for every operation in /openapi.json but the never-ending
    ``GET /v1/events``, drawn once for both property-based tests."""
    loaded = schemathesis.openapi.from_url(f"{fuzzed_stack.url}/openapi.json", timeout=30)
    loaded.config.output.sanitization.update(enabled=False)  # show max_tokens, not [Filtered]
    schema = loaded.exclude(method="GET", path="/v1/events")  # streams until disconnected
    fuzzed: list[Fuzzed] = []
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            raise result.err()
        for mode in schemathesis.GenerationMode:
            fuzzed.append(_generate(result.ok(), mode))
    return fuzzed


def _no_key_yet(stack: ApiStack) -> bool:
    """Whether the stack answers a request without a key (no key was added)."""
    return httpx.get(f"{stack.url}/v1/models", timeout=REQUEST_TIMEOUT_S).status_code == 200


@pytest.mark.slow
def test_openapi_operations_never_fail_on_generated_requests(
    fuzzed_stack: ApiStack, fuzz_cases: list[Fuzzed]
) -> None:
    """Valid and invalid requests for every operation in /openapi.json: no 5xx, no hang, and
    every 4xx in OpenAI's shape. Afterwards, the projector must still be projecting."""
    stack = fuzzed_stack
    # Before the fuzz as a user key (below), which adds keys: without a key, every request
    # would be a 401.
    assert _no_key_yet(stack), "the stack has keys: the fuzz without a key must run first"
    labels = {f.operation.label for f in fuzz_cases}
    assert {
        f"POST {CHAT}",
        f"POST {COMPLETIONS}",
        "POST /v1/instances",
        "DELETE /v1/instances/{instance_id}",
        "POST /v1/placement/preview",
        "GET /v1/state",
        "GET /healthz",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        "POST /v1/responses",
        "GET /v1/responses/{response_id}",
        "POST /v1/embeddings",
        "POST /v1/rerank",
        "POST /api/chat",
        "POST /api/generate",
        "POST /api/embed",
        "GET /api/tags",
    } <= labels, labels
    assert "GET /v1/events" not in labels

    problems: list[str] = []
    with requests.Session() as session:
        for fuzzed in fuzz_cases:
            problems += _send(fuzzed, stack.url, session)
    if not _run_sync(_projection_alive(stack, "probe-after-fuzz", PROJECTION_WAIT_S)):
        problems.append("the projector stopped projecting during the run")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def _owned_events() -> list[EventBase]:
    """Two user keys; a stored response and a task of the first, each holding ``SECRET``."""
    keys: list[EventBase] = [
        KeyAdded(key_id=k, origin="test", name=k, role="user", digest=key_digest(k))
        for k in (OWNER_KEY, OTHER_KEY)
    ]
    text = SECRET.decode()
    return [
        *keys,
        ResponseStored(
            response_id=OWNED_RESPONSE,
            origin="test",
            owner=OWNER_KEY,
            model_id=KNOWN_MODEL,
            response={"id": OWNED_RESPONSE, "object": "response", "output_text": text},
            input_items=[{"id": "msg_1", "type": "message", "role": "user", "content": text}],
        ),
        TaskCreated(
            task_id="owned-task",
            model_id=KNOWN_MODEL,
            origin="test",
            owner=OWNER_KEY,
            messages=[ChatMessage(role="user", content=text)],
        ),
    ]


@pytest.mark.slow
def test_no_route_shows_one_key_what_another_made(
    fuzzed_stack: ApiStack, fuzz_cases: list[Fuzzed]
) -> None:
    """Every operation, fuzzed as a user key: none shows a stored response or a task that
    another user key made (a response id in a path or a ``previous_response_id`` is drawn as
    that response's half the time), no admin route lets it through, and no 5xx. The requests
    are the fuzz's above, on its stack, which this test gives keys."""
    stack = fuzzed_stack
    _run_sync(_publish(stack, _owned_events()))
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}

    async def keys_taken(client: httpx.AsyncClient) -> bool:
        r = await client.get(f"/v1/responses/{OWNED_RESPONSE}", headers=headers)
        return r.status_code == 404 and (await client.get("/v1/models")).status_code == 401

    assert _run_sync(_eventually(stack.url, keys_taken, timeout=PROJECTION_WAIT_S))
    owner = {"Authorization": f"Bearer {OWNER_KEY}"}
    mine = httpx.get(f"{stack.url}/v1/responses/{OWNED_RESPONSE}", headers=owner)
    assert mine.status_code == 200 and SECRET in mine.content  # the owner's: shown
    caller = Caller(headers, SECRET, user=True)
    problems: list[str] = []
    with requests.Session() as session:
        for fuzzed in fuzz_cases:
            problems += _send(fuzzed, stack.url, session, caller)
    events = httpx.get(f"{stack.url}/v1/events", headers=headers, timeout=10)
    assert events.status_code == 403  # the feed (every prompt): admins only
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


async def _publish(stack: ApiStack, events: list[EventBase]) -> None:
    nc = await connect(stack.nats_url, name="test-fuzz-keys")
    try:
        pub = Publisher(nc.jetstream())
        for event in events:
            await pub.publish(event)
    finally:
        await nc.close()


# --- 2. hand-written bad requests -----------------------------------------------------------

# fmt: off
_BAD = [
    # (path, body: bytes sent as is, or JSON; expected param; a piece of the message)
    pytest.param(CHAT, b"this is not json", None, "not valid JSON", id="body-not-json"),
    pytest.param(CHAT, b'["model", "m"]', None, "valid dictionary", id="json-not-an-object"),
    pytest.param(CHAT, b'"just a string"', None, "valid dictionary", id="json-a-string"),
    pytest.param(CHAT, {"model": "", "messages": MESSAGES}, "model", "at least 1",
                 id="empty-model"),
    pytest.param(CHAT, {"model": "m"}, "messages", "Field required", id="missing-messages"),
    pytest.param(CHAT, {"model": "m", "messages": []}, "messages", "at least 1",
                 id="empty-messages"),
    pytest.param(CHAT, {"model": "m", "messages": "hello"}, "messages", "valid list",
                 id="messages-a-string"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": "ten"}, "max_tokens",
                 "valid integer", id="max-tokens-a-string"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "temperature": "hot"},
                 "temperature", "valid number", id="temperature-a-string"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": -1}, "max_tokens",
                 "greater than or equal to 1", id="max-tokens-negative"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens",
                 "greater than or equal to 1", id="max-tokens-zero"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "max_completion_tokens": 0},
                 "max_completion_tokens", "greater than or equal to 1",
                 id="max-completion-tokens-zero"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 5,
                        "max_completion_tokens": 6}, None, "differ",
                 id="max-tokens-disagree"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "n": 9}, "n",
                 "less than or equal to 8", id="n-9"),
    pytest.param(CHAT, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
        "messages.0.content.0", "does not fetch image URLs", id="image-url-not-fetched"),
    pytest.param(CHAT, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        "messages.0.content.0", "the image cannot be read", id="image-unreadable"),
    pytest.param(CHAT, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
        "messages.0", "audio", id="audio-part"),
    pytest.param(CHAT, {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
                 "messages.0", "tool_call_id", id="tool-message-without-call-id"),
    pytest.param(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        "messages.0", "only an assistant", id="user-with-tool-calls"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "response_format": {"type": "xml"}},
                 "response_format", "not supported", id="response-format-xml"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}}}},
        "response_format.json_schema.schema", "minimum", id="schema-keyword-unsupported"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"properties": 3}}}},
        "response_format.json_schema.schema", "properties", id="schema-malformed"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "tools": [
        {"type": "custom", "custom": {"name": "x"}}]}, "tools.0", "only functions",
        id="tool-not-a-function"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name",
        "pattern", id="tool-name-invalid"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools.0.function.parameters", "type 'object'", id="tool-parameters-not-an-object"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}}]},
        "tools.0.function.parameters", "points to nothing", id="tool-schema-ref-to-nothing"),
    # Several unrelated errors: the first one's own message and field, not a vague one.
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "temperature": "hot", "top_p": "x",
                        "n": "many"},
        "temperature", "valid number", id="several-errors-the-first"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, None,
        "not among the tools", id="tool-choice-unknown-function"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "tool_choice": "required"}, None,
                 "needs tools", id="tool-choice-required-without-tools"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "top_logprobs": 2}, None,
                 "needs logprobs", id="top-logprobs-without-logprobs"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "logprobs": True,
                        "top_logprobs": 21}, "top_logprobs", "less than or equal to 20",
                 id="top-logprobs-21"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "logit_bias": {"abc": 1}},
                 "logit_bias", "token ids", id="logit-bias-not-a-token"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "logit_bias": {"5": 101}},
                 "logit_bias.5", "less than or equal to 100", id="logit-bias-too-large"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "modalities": ["text", "audio"]},
                 None, "audio output", id="audio-output"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "functions": [{"name": "f"}]},
                 None, "send tools", id="legacy-functions"),
    pytest.param(COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 6}, "logprobs",
                 "less than or equal to 5", id="completions-logprobs-6"),
    pytest.param(COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, None,
                 "needs echo", id="completions-max-tokens-0-without-echo"),
    pytest.param(COMPLETIONS, {"model": "m", "prompt": "x", "suffix": "y"}, None, "suffix",
                 id="completions-suffix"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "stop": list("abcde")}, "stop",
                 "at most 4 stop", id="five-stops"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "temperature": 3}, "temperature",
                 "less than or equal to 2", id="temperature-3"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "top_p": 0}, "top_p",
                 "greater than 0", id="top-p-0"),
    pytest.param(CHAT, {"model": "m", "messages": MESSAGES, "presence_penalty": -3},
                 "presence_penalty", "greater than or equal to -2",
                 id="presence-penalty-too-low"),
    pytest.param(CHAT, {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]},
                 "messages.0.role", "'user'", id="unknown-role"),
    pytest.param(CHAT, {"model": "m", "messages": [{"content": "hi"}]}, "messages.0.role",
                 "Field required", id="missing-role"),
    # Python's JSON parser accepts NaN, which no range check passes.
    pytest.param(CHAT, b'{"model": "m", "messages": [{"role": "user"}], "temperature": NaN}',
                 "temperature", "less than or equal to 2", id="temperature-nan"),
    pytest.param(CHAT, b'{"model": "m\xff"}', None, "error parsing the body",
                 id="invalid-utf8"),
    # JSON allows a lone surrogate's escape; no event can hold one (it was a 500).
    pytest.param(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
                 "messages.0.content", "lone UTF-16 surrogate", id="lone-surrogate"),
    pytest.param(COMPLETIONS, '{"model": "m", "prompt": "\udfff"}'.encode("utf-8", "surrogatepass"),
                 "prompt", "lone UTF-16 surrogate", id="lone-surrogate-raw-bytes"),
    pytest.param(COMPLETIONS, {"model": "m", "prompt": ["one", "two"]}, "prompt",
                 "one prompt per request", id="completions-two-prompts"),
    pytest.param(COMPLETIONS, {"model": "m", "prompt": []}, "prompt", "one prompt per request",
                 id="completions-no-prompt"),
    pytest.param(COMPLETIONS, {"model": "m"}, "prompt", "Field required",
                 id="completions-missing-prompt"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "placement": "{not json"},
                 "placement", "invalid placement", id="instances-placement-not-json"),
    pytest.param("/v1/instances", {"model": "nope", "placement": "{not json"},
                 "placement", "invalid placement", id="instances-placement-unknown-model"),
    pytest.param("/v1/placement/preview", {"model": KNOWN_MODEL, "placement": "[]"},
                 "placement", "invalid placement", id="preview-placement-a-list"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "replicas": 65}, "replicas",
                 "less than or equal to 64", id="instances-65-replicas"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "context_length": 0},
                 "context_length", "greater than or equal to 1",
                 id="instances-context-length-0"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "slots": 65}, "slots",
                 "less than or equal to 64", id="instances-65-slots"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "slots": 0}, "slots",
                 "greater than or equal to 1", id="instances-0-slots"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "slots": "4"}, "slots",
                 "valid integer", id="instances-slots-a-string"),
    pytest.param("/v1/placement/preview", {"model": KNOWN_MODEL, "slots": 2.5}, "slots",
                 "valid integer", id="preview-slots-a-fraction"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "role": "embed", "slots": 2}, "slots",
                 "an embed instance serves one task at a time", id="instances-embed-slots"),
    pytest.param("/v1/instances", {"model": KNOWN_MODEL, "slots": 2,
                                   "placement": {"chat": {"devices": [f"{NODE}:cpu"], "slots": 3}}},
                 "slots", "the placement gives 3", id="instances-slots-twice"),
]
# fmt: on


@pytest.mark.parametrize(("path", "body", "param", "message"), _BAD)
async def test_bad_request_is_a_400_naming_the_problem(
    client: httpx.AsyncClient, path: str, body: bytes | object, param: str | None, message: str
) -> None:
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert message.lower() in err["message"].lower(), err
    if param is not None:
        assert param in err["message"], err  # the message says where, as well as param


async def test_unknown_model_is_a_404_model_not_found(client: httpx.AsyncClient) -> None:
    requests_: list[tuple[str, dict[str, object]]] = [
        (CHAT, {"messages": MESSAGES}),
        (COMPLETIONS, {"prompt": "hi"}),
    ]
    for path, body in requests_:
        err = _error(await client.post(path, json=body | {"model": "no-such-model"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model", err
        assert "no-such-model" in err["message"] and KNOWN_MODEL in err["message"], err


async def test_known_model_without_a_runner_is_a_503_saying_why(client: httpx.AsyncClient) -> None:
    # Without `model`, the request goes to the only model the cluster knows.
    for named, stream in ((True, False), (True, True), (False, False)):
        body = {"messages": MESSAGES, "stream": stream} | ({"model": KNOWN_MODEL} if named else {})
        err = _error(await client.post(CHAT, json=body), 503)
        assert err["code"] == "model_not_ready", err
        assert f"model `{KNOWN_MODEL}`" in err["message"], err
        assert "no instance of it is running" in err["message"], err


@pytest.mark.parametrize("model", ["no-such-model", KNOWN_MODEL])
async def test_absurd_max_tokens_fails_only_for_want_of_a_model(
    client: httpx.AsyncClient, model: str
) -> None:
    """max_tokens has no upper bound (OpenAI's limit depends on the model), so 10**12 passes
    validation; with no runner the request then fails as any would: 404 for a model the
    cluster does not know, 503 for one it knows. Whatever the API decides, never another 5xx.
    (With a runner, see test_chat_with_huge_max_tokens_keeps_the_projection_alive.)"""
    body = {"model": model, "messages": MESSAGES, "max_tokens": 10**12}
    r = await client.post(CHAT, json=body)
    allowed = {400, 404} if model != KNOWN_MODEL else {400, 503}
    err = _error(r, allowed)
    if r.status_code != 400:
        assert err["code"] in ("model_not_found", "model_not_ready"), err


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_oversized_prompt_is_refused_quickly_without_a_5xx(
    client: httpx.AsyncClient, path: str
) -> None:
    """A 2 MB prompt for a model nobody serves: a 4xx (413 here) within the timeout."""
    text = "x" * (2 * 1024**2)
    body: dict[str, object] = {"model": "no-such-model"}
    body |= {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
    started = time.monotonic()
    r = await client.post(path, json=body)
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    assert 400 <= r.status_code < 500, r.text[:500]
    _error(r, r.status_code)


# Where a dialect puts its text, and the field its 413 names.
_TEXT_FIELD = {
    CHAT: "messages",
    COMPLETIONS: "prompt",
    "/v1/responses": "input",
    "/v1/embeddings": "input",
}


@pytest.mark.parametrize("path", list(_TEXT_FIELD))
async def test_a_prompt_too_large_for_the_log_is_a_413(
    client: httpx.AsyncClient, path: str
) -> None:
    """Larger than a NATS message may be (1 MiB): refused before anything is published, and
    the API keeps answering (the server would have closed its connection)."""
    text = "x" * (1024**2 + 10)
    field = _TEXT_FIELD[path]
    body: dict[str, object] = {"model": KNOWN_MODEL}
    body[field] = [{"role": "user", "content": text}] if field == "messages" else text
    if path != "/v1/embeddings":
        body["stream"] = True
    err = _error(await client.post(path, json=body), 413)
    assert err["code"] == "request_too_large" and "more than the 1048576 bytes" in err["message"]
    assert err["param"] == field, err
    after = await client.post(path, json=body | {"model": "no-such-model"})
    assert after.status_code == 413  # the size is the request's own problem, whatever the model
    small = {"model": KNOWN_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post(CHAT, json=small)).status_code == 503  # no runner, but answering


async def test_a_tool_too_large_for_the_log_is_a_413(client: httpx.AsyncClient) -> None:
    """Each message and tool is stored on its own (bus/stores/parts.py): tools that are more than a
    NATS message together are taken, one that is more alone is named."""
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * 50_000}}
        for i in range(22)
    ]
    body = {"model": KNOWN_MODEL, "messages": MESSAGES, "tools": tools}
    assert (await client.post(CHAT, json=body)).status_code == 503  # taken; no runner to serve
    tools[3]["function"]["description"] = "x" * (1024**2 + 10)  # type: ignore[index]
    err = _error(await client.post(CHAT, json=body), 413)
    assert err["code"] == "request_too_large" and err["param"] == "tools"
    assert "tools[3]" in err["message"], err


async def test_placement_preview_for_an_unknown_model_is_a_404(client: httpx.AsyncClient) -> None:
    err = _error(await client.post("/v1/placement/preview", json={"model": "nope"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model", err


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_unknown_instance_is_a_404(client: httpx.AsyncClient, method: str) -> None:
    err = _error(await client.request(method, "/v1/instances/nope"), 404)
    assert err["param"] == "instance_id" and "'nope'" in err["message"], err


async def test_events_with_a_subject_outside_shoal_is_a_400(client: httpx.AsyncClient) -> None:
    # Streamed, so that a regression that accepts the subject fails instead of hanging.
    async with client.stream("GET", "/v1/events", params={"subject": "foo"}) as r:
        if r.status_code != 200:
            await r.aread()
    err = _error(r, 400)
    assert err["param"] == "subject" and "shoal.events." in err["message"], err


async def test_unknown_path_and_method_are_openai_shaped(client: httpx.AsyncClient) -> None:
    _error(await client.get("/v1/nothing-here"), 404)
    _error(await client.put(CHAT, json={}), 405)


# Valid bodies of each dialect, whose every string the test below gives a lone surrogate.
_TEXT_BODIES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"model": KNOWN_MODEL, "messages": MESSAGES, "stop": ["x"], "user": "u"}),
    (COMPLETIONS, {"model": KNOWN_MODEL, "prompt": "hi", "stop": "s"}),
    ("/v1/messages", {"model": KNOWN_MODEL, "max_tokens": 5, "system": "s", "messages": MESSAGES}),
    ("/v1/responses", {"model": KNOWN_MODEL, "input": "hi", "instructions": "be brief"}),
    ("/v1/embeddings", {"model": KNOWN_MODEL, "input": ["a", "b"]}),
    ("/v1/rerank", {"model": KNOWN_MODEL, "query": "q", "documents": ["a", {"text": "b"}]}),
    ("/api/chat", {"model": KNOWN_MODEL, "messages": MESSAGES, "options": {"stop": ["x"]}}),
    ("/api/generate", {"model": KNOWN_MODEL, "prompt": "hi", "system": "s"}),
    ("/v1/placement/preview", {"model": KNOWN_MODEL, "aliases": ["a"]}),
]


def _string_paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Where the strings of a JSON value are."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _string_paths(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_paths(v, (*path, i))]
    return []


def _replaced(value: Any, path: tuple[str | int, ...], text: str) -> Any:
    if not path:
        return text
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], text)  # type: ignore[index]
    return copy


def test_a_lone_surrogate_in_any_string_is_a_400_naming_it(seeded_stack: ApiStack) -> None:
    """Any string of any dialect's body, given a lone surrogate (escaped, as json.dumps and
    the SDKs send it): a 400 in the dialect's shape that names the field, never a 5xx."""
    strategy = st.sampled_from(_TEXT_BODIES).flatmap(
        lambda pb: st.tuples(
            st.just(pb),
            st.sampled_from(_string_paths(pb[1])),
            st.text(max_size=3),
            st.characters(categories=["Cs"]),
            st.text(max_size=3),
        )
    )
    problems: list[str] = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(drawn=strategy)
    def run(drawn: Any) -> None:
        (path, body), where, before, surrogate, after = drawn
        sent = _replaced(body, where, before + surrogate + after)
        r = session.post(
            f"{seeded_stack.url}{path}",
            data=json.dumps(sent).encode(),
            headers={"content-type": "application/json"},
            timeout=REQUEST_TIMEOUT_S,
        )
        content_type = r.headers.get("content-type", "")
        dialect = dialect_of(path)
        found = _shape_problems(r.status_code, r.content, content_type, dialect)
        param = ".".join(str(p) for p in where)
        if r.status_code != 400:
            found.append(f"status {r.status_code}, not 400")
        elif dialect == "openai" and r.json()["error"]["param"] != param:
            found.append(f"param {r.json()['error']['param']!r}, not {param!r}")
        elif param not in r.text:
            found.append(f"the message does not name {param!r}")
        problems.extend(f"{path} {param}={sent!r}: {p}: {r.text[:300]}" for p in found)

    with requests.Session() as session:
        run()
    assert not problems, "\n".join(problems)


def _tool_body(path: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A chat of ``path``'s dialect offering one tool of ``parameters``."""
    if path == "/v1/messages":
        tool: dict[str, Any] = {"name": "f", "input_schema": parameters}
        return {"model": KNOWN_MODEL, "max_tokens": 5, "messages": MESSAGES, "tools": [tool]}
    if path == "/v1/responses":
        tool = {"type": "function", "name": "f", "parameters": parameters}
        return {"model": KNOWN_MODEL, "input": "hi", "tools": [tool]}
    function = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return {"model": KNOWN_MODEL, "messages": MESSAGES, "tools": [function]}


def _bomb(wide: int, deep: int) -> dict[str, Any]:
    """An object of ``wide`` optional properties, nested ``deep`` times."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(deep):
        schema = {"type": "object", "properties": {f"p{i}": schema for i in range(wide)}}
    return schema


def test_schema_bombs_are_a_400_in_every_dialect(seeded_stack: ApiStack) -> None:
    """Tools whose schemas are too wide, too deep or too large for a grammar: a 400 in the
    dialect's shape naming the tool, never a 5xx or a hang (once they froze a runner)."""
    strategy = st.tuples(
        st.sampled_from([CHAT, "/v1/messages", "/v1/responses", "/api/chat"]),
        st.one_of(
            st.tuples(st.integers(257, 1000), st.just(1)),  # too many properties
            st.tuples(st.just(1), st.integers(70, 200)),  # too deep
            st.tuples(st.integers(60, 250), st.just(2)),  # too large a schema
        ),
    )
    problems: list[str] = []

    @settings(max_examples=12, deadline=None, database=None, derandomize=True)
    @given(drawn=strategy)
    def run(drawn: Any) -> None:
        path, (wide, deep) = drawn
        r = session.post(
            f"{seeded_stack.url}{path}", json=_tool_body(path, _bomb(wide, deep)), timeout=10
        )
        content_type = r.headers.get("content-type", "")
        found = _shape_problems(r.status_code, r.content, content_type, dialect_of(path))
        if r.status_code != 400:
            found.append(f"status {r.status_code}, not 400")
        elif "tools" not in r.text or not ("more than" in r.text or "too deeply" in r.text):
            found.append("the message does not name the tool and what is too much")
        problems.extend(f"{path} {wide}x{deep}: {p}: {r.text[:300]}" for p in found)

    with requests.Session() as session:
        run()
    assert not problems, "\n".join(problems)


def test_bodies_on_the_public_paths_are_refused_unread(seeded_stack: ApiStack) -> None:
    """Any method but GET and HEAD, and any body, on the paths that need no key: a 405 or 413
    before any of it is read (once each was read and parsed on the event loop)."""
    strategy = st.tuples(
        st.sampled_from(["/health", "/healthz", "/", "/static/dashboard.js", "/openapi.json"]),
        st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]),
        st.binary(min_size=1, max_size=2000),
    )
    problems: list[str] = []

    @settings(max_examples=20, deadline=None, database=None, derandomize=True)
    @given(drawn=strategy)
    def run(drawn: Any) -> None:
        path, method, body = drawn
        r = session.request(method, f"{seeded_stack.url}{path}", data=body, timeout=10)
        wanted = 413 if method == "GET" else 405
        if r.status_code != wanted:
            problems.append(f"{method} {path} with {len(body)} bytes: {r.status_code}")

    with requests.Session() as session:
        run()
    assert not problems, "\n".join(problems)


# --- 3. the official SDK ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _sdk(stack: ApiStack) -> AsyncIterator[openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    try:
        yield sdk
    finally:
        await sdk.close()


async def test_sdk_raises_bad_request_for_what_cannot_be_honoured(
    seeded_stack: ApiStack,
) -> None:
    async with _sdk(seeded_stack) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], n=9
            )
        assert caught.value.status_code == 400
        assert caught.value.param == "n" and caught.value.type == "invalid_request_error"
        assert "less than or equal to 8" in caught.value.message

        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"$ref": "#/$defs/X"}},
                            },
                        },
                    }
                ],
            )
        assert caught.value.param == "tools.0.function.parameters"
        assert "$ref '#/$defs/X' (at properties.x) points to nothing" in caught.value.message

        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.completions.create(model="m", prompt=["one", "two"])
        assert caught.value.param == "prompt"


async def test_sdk_raises_not_found_for_an_unknown_model(seeded_stack: ApiStack) -> None:
    async with _sdk(seeded_stack) as sdk:
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 404
        assert caught.value.code == "model_not_found" and caught.value.param == "model"

        # A model that cannot answer now: 503, which the SDK raises as a server error.
        with pytest.raises(openai.InternalServerError) as unavailable:
            await sdk.chat.completions.create(
                model=KNOWN_MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert unavailable.value.status_code == 503
        assert unavailable.value.code == "model_not_ready"


# --- what the fuzzing found (each was a bug, fixed since) ---------------------------------

_ONE_DEVICE = [f"{NODE}:cpu"]
_PLACEMENT_CRASHES = [
    pytest.param(
        {"placement": {"chat": {"devices": _ONE_DEVICE, "replicas": 2**62}}},
        id="spec-replicas-2**62",
    ),
    pytest.param(
        {"placement": {"chat": {"devices": _ONE_DEVICE, "tensor_split": [1e308]}}},
        id="tensor-split-1e308",
    ),
    pytest.param(
        {
            "placement": {
                "chat": {"devices": [*_ONE_DEVICE, f"{NODE}:gpu0"], "tensor_split": [1e308, 1e308]}
            }
        },
        id="tensor-split-sum-overflows",
    ),
    pytest.param({"context_length": 10**400}, id="context-length-10**400"),
]


@pytest.mark.parametrize("path", ["/v1/placement/preview", "/v1/instances"])
@pytest.mark.parametrize("extra", _PLACEMENT_CRASHES)
async def test_absurd_placement_is_refused_without_a_5xx(
    client: httpx.AsyncClient, path: str, extra: dict[str, object]
) -> None:
    r = await client.post(path, json={"model": KNOWN_MODEL} | extra)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:  # refused, in OpenAI's shape; or placed (huge weights are weights)
        _error(r, 400)


@pytest.mark.parametrize(
    "subject", ["shoal.events.>.x", "shoal.events.a\tb", "shoal.events.", "shoal.events..x"]
)
async def test_events_with_an_invalid_nats_subject_is_a_400(
    client: httpx.AsyncClient, subject: str
) -> None:
    async with client.stream("GET", "/v1/events", params={"subject": subject}) as r:
        status = r.status_code
        if status != 200:
            await r.aread()
    assert status == 400
    _error(r, 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": "m", "messages": MESSAGES, "stop": 5}, "stop"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (COMPLETIONS, {"model": "m", "prompt": 5}, "prompt"),
    ],
)
async def test_wrong_type_for_a_union_field_names_the_field(
    client: httpx.AsyncClient, path: str, body: dict[str, object], param: str
) -> None:
    err = _error(await client.post(path, json=body), 400)
    assert err["param"] == param, err


async def test_missing_body_says_the_body_is_missing(client: httpx.AsyncClient) -> None:
    err = _error(await client.post(CHAT), 400)
    assert "body" in err["message"].lower(), err


async def test_openapi_document_describes_the_errors_sent(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    with_422 = [
        f"{method.upper()} {path}"
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
        if "422" in op.get("responses", {})
    ]
    assert with_422 == []


@pytest.mark.slow
async def test_queued_instance_with_huge_context_keeps_the_projection_alive(
    api_stack: ApiStack,
) -> None:
    await _seed(api_stack)
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=REQUEST_TIMEOUT_S) as client:
        body = {"model": KNOWN_MODEL, "context_length": 2**64, "queue": True}
        r = await client.post("/v1/instances", json=body)
    if r.status_code == 400:  # refused up front: fine
        _error(r, 400)
        return
    assert r.status_code == 202, r.text
    assert await _projection_alive(api_stack, "probe-after-instance", PROJECTION_WAIT_BUG_S)


@pytest.mark.slow
async def test_chat_with_huge_max_tokens_keeps_the_projection_alive(api_stack: ApiStack) -> None:
    await _seed(api_stack, serving=True)
    body = {"model": KNOWN_MODEL, "messages": MESSAGES, "max_tokens": 2**64, "stream": True}
    async with (
        httpx.AsyncClient(base_url=api_stack.url, timeout=REQUEST_TIMEOUT_S) as client,
        client.stream("POST", CHAT, json=body) as r,
    ):
        if r.status_code == 400:  # refused up front: fine
            await r.aread()
            _error(r, 400)
            return
        assert r.status_code == 200
        # The first event (the assistant's role) comes once the task is published; no runner
        # answers it, so leave (which cancels the task).
        first = await anext(r.aiter_lines())
        assert first.startswith("data: ") and "chatcmpl-" in first, first
    assert await _projection_alive(api_stack, "probe-after-chat", PROJECTION_WAIT_BUG_S)

"""Fixtures: a real nats-server per test, and real SQLite / PostgreSQL databases."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.streams import ensure_streams
from harness.databases import ScratchDatabases
from harness.hosts import Network
from harness.models.templated import WithTemplate, with_template
from inference.engines.mlx.blas import set_threads
from projectors import database

POSTGRES_ENV = "SHOAL_TEST_POSTGRES_URL"

# MLX's OpenBLAS is loaded above, before a test module imports mlx (blas.py says why it must
# come first); one thread, as the suite's llama.cpp runs, since its workers share the cores.
set_threads(1)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A fresh nats-server with JetStream on a free port (never the system one on 4222)."""
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, name="test")
    yield client
    await client.close()


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    context = nc.jetstream()
    await ensure_streams(context)
    return context


MakeDb = Callable[[], Awaitable[str]]


@pytest.fixture(scope="session")
def scratch_databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScratchDatabases]:
    dbs = ScratchDatabases(
        tmp_path_factory.mktemp("databases"), os.environ.get(POSTGRES_ENV), prefix="shoal_test"
    )
    yield dbs
    asyncio.run(dbs.cleanup())


@pytest.fixture(params=["sqlite", "postgresql"])
def make_db(request: pytest.FixtureRequest, scratch_databases: ScratchDatabases) -> MakeDb:
    """Makes new, empty databases of one kind: SQLite files, or PostgreSQL databases created
    on the server named by SHOAL_TEST_POSTGRES_URL (skipped when not set) and dropped at the end
    of the session. Tests that take it run on both kinds."""
    kind: str = request.param
    if kind == "postgresql" and not os.environ.get(POSTGRES_ENV):
        pytest.skip(f"{POSTGRES_ENV} is not set")

    async def make() -> str:
        return await scratch_databases.new(kind, "projection")

    return make


@pytest.fixture
async def db_url(make_db: MakeDb) -> str:
    return await make_db()


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = database.create_engine(db_url)
    yield eng
    await eng.dispose()


@pytest.fixture(scope="session")
def tiny_projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight projector (mmproj) for SmolLM2, written once
    (``harness/models/tiny_projector.py``)."""
    # gguf and numpy: only where it is used
    from harness.models.tiny_projector import write_tiny_projector

    return write_tiny_projector(tmp_path_factory.mktemp("projector") / "mmproj-tiny.gguf")


# Session fixtures that cost seconds to make: the modules that name one run in one xdist
# worker, which makes it once. (The models converted for the tests need not: they are made once
# in a cache on disk that the workers share, harness/models/cache.py.)
SHARED_FIXTURES = ("up_cluster",)
TESTS = Path(__file__).parent


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@functools.cache
def shared_fixture(module: str) -> str | None:
    """The first of SHARED_FIXTURES that a test module names (read as text: xdist's scheduler,
    which needs it, has no collected items)."""
    text = (TESTS.parent / module).read_text()
    return next((name for name in SHARED_FIXTURES if name in text), None)


# The modules that take longest (make test's --durations), longest first: each group below
# starts with them, so that no worker is left running one of them alone at the end.
LONGEST = (
    "tests/clients/test_agents.py",
    "tests/inference/engines/mlx/test_pipeline.py",
    "tests/faults/test_partitions.py",
    "tests/api/images/test_generation_cluster.py",
    "tests/inference/engines/contract/test_batching.py",
    "tests/inference/engines/contract/test_logprobs.py",
    "tests/services/test_nats_cluster_serving.py",
    "tests/cli/test_up_ha.py",
    "tests/bus/test_nats_cluster.py",
    "tests/inference/engines/contract/test_thinking_budget.py",
    "tests/api/test_fuzz.py",
    "tests/api/test_edge.py",
    "tests/services/test_worker_runner.py",
    "tests/inference/engines/contract/test_repeated_calls.py",
    "tests/inference/engines/mlx/test_sampling.py",
    "tests/inference/engines/llamacpp/test_engine.py",
    "tests/services/runner/pipelines/test_llamacpp.py",
    "tests/services/planner/test_planner_nats_cluster.py",
    "tests/faults/test_nats_restart.py",
    "tests/faults/test_worker_killed.py",
    "tests/faults/test_runner_killed.py",
    "tests/faults/test_runner_stalled.py",
    "tests/projectors/test_projector.py",
    "tests/services/test_cli.py",
    "tests/projectors/test_projector_fuzz.py",
    "tests/projectors/test_snapshot.py",
    "tests/services/planner/test_planner.py",
    "tests/test_readme.py",
    "tests/test_readme_machines.py",
    "tests/api/test_api.py",
    "tests/inference/test_job.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules without a test marked slow first (in their order), then the others: those
    that share a session fixture (the most work in one worker), the LONGEST, the rest. A failure
    of the pure logic shows in seconds, not after the end-to-end runs, and a module's tests stay
    together, so that its module-scoped fixtures are made once."""
    slow = {_module(item) for item in items if item.get_closest_marker("slow") is not None}

    def order(item: pytest.Item) -> tuple[bool, bool, int]:
        module = _module(item)
        long = LONGEST.index(module) if module in LONGEST else len(LONGEST)
        return module in slow, shared_fixture(module) is None, long

    items.sort(key=order)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under xdist (``-n``): a module's tests in one worker, the modules that share a session
    fixture in one worker, handed out in the order ``pytest_collection_modifyitems`` gave."""
    from xdist.scheduler import LoadScopeScheduling

    # xdist would hand out the modules with the most tests first; this order is better (above).
    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return shared_fixture(module) or module

    return ModuleScheduling(config, log)


# A worker keeps a runner started ahead by default (--warm-runner): an idle process and a
# second of CPU per worker, which the suite's hundred-odd workers would spend for nothing.
# tests/cli/test_up_on_demand.py starts its `shoal up` with the spare.
os.environ.setdefault("SHOAL_WARM_RUNNER", "0")


@pytest.fixture
def hosts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Network]:
    """Test hosts with their own addresses (``harness/hosts.py``): 3, or as many as
    ``@pytest.mark.parametrize("hosts", [N], indirect=True)`` says. Where they cannot be made
    (not root) the test fails, saying why: CI runs as root."""
    count: int = getattr(request, "param", 3)
    with Network(tmp_path / "hosts", count) as net:
        yield net


@pytest.fixture
def hosts_nats(hosts: Network, tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server for the hosts, on this machine's side of their bridge: the hosts reach it
    across their links, as another machine; the test and what it starts here reach it at the
    same address."""
    with EmbeddedNats(tmp_path / "nats", host=hosts.gateway) as server:
        yield server


@pytest.fixture
async def hosts_js(hosts_nats: EmbeddedNats) -> AsyncIterator[JetStreamContext]:
    client = await connect(hosts_nats.url, name="test")
    context = client.jetstream()
    await ensure_streams(context)
    yield context
    await client.close()


@pytest.fixture(scope="session")
def smollm2_with_template() -> WithTemplate:
    """SmolLM2 with another chat template: ``with_template``."""
    return with_template

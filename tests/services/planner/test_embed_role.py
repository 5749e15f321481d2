"""The embed role from the request to the runner's spec: placement (weights and a small
context), the spec's ``{"embed": ...}`` entry, the planner's decision, the worker's runner
spec, and ``shoal instances create --role embed``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from events.catalogue import InstancePlaced, InstanceRequested
from events.units import GiB, MiB
from harness.processes import SHOAL, Processes
from projectors.rules import changes_for
from services.models.footprint import DEFAULT_EMBED_CONTEXT_LENGTH, context_for
from services.planner.decisions import decide
from services.planner.placement import place
from services.planner.placement_spec import instance_role
from services.worker.worker import Worker, WorkerConfig
from tests.services.planner.builders import POLICY, ask, at, fold_all, model, node, placement, view
from tests.services.planner.test_planner import _nodes

KV = 1024 * 1024  # bytes per token of context


def test_an_embed_instance_needs_its_weights_and_a_small_context() -> None:
    assert context_for(8192, None, "embed") == DEFAULT_EMBED_CONTEXT_LENGTH == 512
    assert context_for(256, None, "embed") == 256  # never more than the model's own
    assert context_for(8192, 4096, "embed") == 4096  # what was asked for
    cluster = view(node("a", 10 * GiB))
    added = model(size=GiB, kv=KV)
    chat = placement(place(cluster, ask(added)))
    embed = placement(place(cluster, replace(ask(added), role="embed")))
    assert (chat.context_length, embed.context_length) == (2048, 512)
    assert embed.need_bytes == GiB + 512 * KV < chat.need_bytes


def test_the_role_comes_from_the_request_or_from_the_spec_s_one_entry() -> None:
    assert instance_role(None) == "chat"
    assert instance_role(None, "embed") == "embed"
    assert instance_role('{"embed": {"devices": ["a:cpu"]}}') == "embed"
    assert (
        instance_role('{"chat": {"devices": ["a:cpu"]}, "embed": {"devices": ["b:cpu"]}}', "embed")
        == "embed"
    )
    both = '{"chat": {"devices": ["a:cpu"]}, "embed": {"devices": ["b:cpu"]}}'
    assert instance_role(both) == "chat"
    for spec, asked, message in [
        ('{"chat": {"devices": ["a:cpu"]}}', "embed", "no entry for role 'embed'"),
        (None, "classify", "unknown role 'classify'"),
    ]:
        try:
            instance_role(spec, asked)
        except ValueError as exc:
            assert message in str(exc)
        else:
            raise AssertionError(f"{spec} {asked} was accepted")


async def test_the_planner_places_an_embed_instance_by_its_spec_entry_and_the_worker_runs_it(
    nc: Client, tmp_path: Path
) -> None:
    spec = '{"embed": {"devices": ["b:cpu"]}}'
    embed = InstanceRequested(
        instance_id="e", model_id="m", origin="t", ts=at(1), placement=spec, role="embed"
    )
    chat = InstanceRequested(instance_id="c", model_id="m", origin="t", ts=at(1))
    state = fold_all(node("a", 4 * GiB), node("b", 4 * GiB), model(size=GiB, kv=KV), embed, chat)
    decisions = decide(state, at(2), POLICY)
    placed = {
        d.event.instance_id: d.event for d in decisions if isinstance(d.event, InstancePlaced)
    }
    assert [(s.node_id, s.device) for s in placed["e"].shards] == [("b", "cpu")]
    # The worker on b runs the embed shard with the embed role and its small context.
    for d in decisions:
        state.commit(changes_for(state, d.event))
    worker = Worker(nc, WorkerConfig(nats_url="nats://x", node_id="b", data_dir=tmp_path))
    worker.state = state
    (row,) = state.runners_of("e")
    runner = worker._spec(row)
    assert (runner.role, runner.n_ctx, runner.instance_id) == ("embed", 512, "e")
    (chat_row,) = state.runners_of("c")
    assert (worker._spec(chat_row).role, worker._spec(chat_row).n_ctx) == ("chat", 2048)


async def test_cli_create_with_the_embed_role(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {
        **os.environ,
        "SHOAL_DATA_DIR": str(tmp_path / "data"),
        "SHOAL_NATS_URL": nats_server.url,
        "SHOAL_DB_URL": db,
    }

    async def shoal(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run, [SHOAL, *args], capture_output=True, text=True, env=env, timeout=90
        )

    with Processes(tmp_path / "logs", env) as procs:
        procs.start("projector", "projector")
        procs.start("planner", "planner")
        await procs.wait_log("projector", "resuming after seq")
        await _nodes(Publisher(js), {"n-a": 1024 * MiB})
        preview = await shoal("placement", "preview", "smollm2-135m", "--role", "embed")
        assert preview.returncode == 0 and "n-a:cpu" in preview.stdout, preview.stderr
        created = await shoal(
            "instances", "create", "smollm2-135m", "--role", "embed", "--id", "emb-1"
        )
        assert created.returncode == 0, created.stderr
        assert "placed emb-1 on n-a:cpu[0:30]" in created.stdout
        preview = await shoal("placement", "preview", "smollm2-135m", "--role", "embed")
        assert preview.returncode == 0 and "context 512 tokens" in preview.stdout, preview.stdout
        by_spec = await shoal(
            "instances",
            "create",
            "smollm2-135m",
            "--id",
            "emb-2",
            "--placement",
            '{"embed": {"devices": ["n-a:cpu"]}}',
        )
        assert by_spec.returncode == 0, by_spec.stderr
        wrong = await shoal(
            "instances",
            "create",
            "smollm2-135m",
            "--role",
            "chat",
            "--placement",
            '{"embed": {"devices": ["n-a:cpu"]}}',
        )
        assert wrong.returncode == 1 and "no entry for role 'chat'" in wrong.stderr
        listed = await shoal("instances", "list", "--json")
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        roles = {row["instance_id"]: row["role"] for row in rows}
        assert roles == {"emb-1": "embed", "emb-2": "embed"}

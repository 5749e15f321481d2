"""The worker: one per machine. It joins the cluster, sends its resource profile every few
seconds (the heartbeat), runs the runners of the shards placed on it, reports their deaths, and
gives the weight files its cache holds to other nodes' runners (``weights_server``), and keeps
that cache within its size budget (``cache_upkeep``).

It keeps no state of its own: which shards belong here is folded from the instance and model
events with the same rules the projector uses (``projectors.rules``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import nats.errors
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from bus.connection import server_listen_host
from bus.publisher import Publisher
from bus.streams import StreamSettings, ensure_streams
from events.catalogue import (
    ModelRemoved,
    NodeJoined,
    NodeLeft,
    ResourceProfiled,
    RunnerStateChanged,
    TaskCreated,
    TaskFailed,
    WeightFile,
    parse_event,
    utc_now,
)
from events.kinds import main_engine
from events.records import Speculative
from events.subjects import aggregate_filter
from projectors.rows import RunnerRow
from projectors.rules import changes_for
from projectors.state import ClusterState
from services.addresses import LOOPBACK, Advertised, advertised, is_loopback
from services.models.cache_budget import DEFAULT_CACHE_SIZE, CacheSize
from services.models.footprint import context_for
from services.models.weights_cache import WeightsCache
from services.resume import continuation, describe, message_id, read_logged, superseded_since
from services.runner import CurrentTasks, RunnerSpec
from services.worker.cache_upkeep import CacheUpkeep
from services.worker.device_probe import Probe, probe
from services.worker.profile import collect_profile, nvidia_gpus, rss_bytes
from services.worker.reconcile import describe_exit, desired_runners, plan, runner_slots
from services.worker.supervisor import Supervisor
from services.worker.weights_server import WeightsServer

log = logging.getLogger(__name__)

VERSION = "0.1.0"
ORDERED_HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class WorkerConfig:
    nats_url: str
    node_id: str
    data_dir: Path
    memory_limit: int | None = None
    heartbeat_s: float = 2.0
    runner_threads: int | None = None
    stream_settings: StreamSettings | None = None
    # Where this node's runners listen for the other stages of a pipeline (llama.cpp RPC, MLX
    # ring) and its weights server for other nodes. None: chosen (``address.py``).
    data_host: str | None = None
    # The address the NATS server on this machine listens on, when this process runs it
    # (`shoal up`); None: asked of the server this worker is connected to.
    nats_listen_host: str | None = None
    # Tasks each of this node's runners serves at once, whatever its instance was placed with
    # (the operator answers for the memory). None: the placement's.
    slots: int | None = None
    # The weights cache's size budget (--cache-size): beyond it, unused models are evicted.
    cache_size: CacheSize = DEFAULT_CACHE_SIZE
    # Keep a runner process started ahead for the next runner (--warm-runner).
    warm_runner: bool = False

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"


class Worker:
    def __init__(self, nc: Client, config: WorkerConfig) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._pub = Publisher(self._js)
        self.config = config
        self.state = ClusterState()  # instances, runners and models, folded from the log
        self.supervisor = Supervisor(
            self._runner_exited, config.data_dir / "logs", warm_spare=config.warm_runner
        )
        self._caught_up = asyncio.Event()
        self._devices = Probe()  # what the engines can run on: asked once, in run()
        self.upkeep = CacheUpkeep(
            WeightsCache(config.models_dir), config.cache_size, config.node_id, self._pub.publish
        )
        # Models removed since the last catch-up: their files, and when they were removed.
        self._removed: dict[str, tuple[list[WeightFile], datetime]] = {}
        self.advertised = Advertised(config.data_host or LOOPBACK, "not chosen yet")

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def data_host(self) -> str:
        """Where this node's runners and weights server listen for other nodes."""
        return self.advertised.address

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_streams(self._js, self.config.stream_settings)
        listen = self.config.nats_listen_host or server_listen_host(self._nc)
        self.advertised = await asyncio.to_thread(
            advertised,
            self.config.data_host,
            self.config.nats_url,
            listen is not None and not is_loopback(listen),
        )
        log.info(
            "node %s: other nodes reach it at %s: %s",
            self.node_id,
            self.advertised.address,
            self.advertised.why,
        )
        self._devices = await probe(len(await asyncio.to_thread(nvidia_gpus)))
        await self._pub.publish(
            NodeJoined(
                node_id=self.node_id,
                origin=self.node_id,
                hostname=socket.gethostname(),
                addresses=_addresses(),
                version=VERSION,
                heartbeat_s=self.config.heartbeat_s,
                advertised=self.advertised.address,
                advertised_why=self.advertised.why,
            )
        )
        await self._heartbeat()
        weights = WeightsServer(WeightsCache(self.config.models_dir), self.data_host, self.node_id)
        weights.start()
        subs = [
            await weights.answer(self._nc),
            # Models and instances in one consumer, so they fold in log order (a model is
            # known before an instance of it is placed).
            await self._js.subscribe(
                aggregate_filter("model"),
                cb=self._on_placement_event,
                ordered_consumer=True,
                # A restarted nats-server has lost this (in-memory) consumer; nats-py makes it
                # again, from the next event, after two missed idle heartbeats: 2-4 s after the
                # restart rather than 10-20 s with the default (5 s), placements unseen.
                idle_heartbeat=ORDERED_HEARTBEAT_S,
                config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.ALL,
                    filter_subjects=[aggregate_filter("model"), aggregate_filter("instance")],
                ),
            ),
        ]
        # Live only (a core subscription): when this node's runners are quiet, the next warm
        # spare may start without slowing them.
        subs.append(
            await self._nc.subscribe(RunnerStateChanged.filter_for(), cb=self._on_runner_state)
        )
        beat = asyncio.create_task(self._heartbeats(stop))
        self.supervisor.preload = not self._devices.llamacpp and self._devices.mlx is None
        self.supervisor.warm()
        try:
            await stop.wait()
        finally:
            beat.cancel()
            for sub in subs:
                await sub.unsubscribe()
            weights.stop()
            await self.supervisor.stop_all()
            await self._pub.publish(NodeLeft(node_id=self.node_id, origin=self.node_id))

    # --- heartbeat ----------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        pids = [pid for r in self.supervisor.runners if (pid := self.supervisor.pid(r))]
        profile = await asyncio.to_thread(
            collect_profile,
            self.config.models_dir,
            self.config.memory_limit,
            rss_bytes(pids),
            self._devices,
        )
        await self._pub.publish(
            ResourceProfiled(node_id=self.node_id, origin=self.node_id, profile=profile)
        )

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                await self._heartbeat()
            except Exception:  # a missed beat is logged; the next one may get through
                log.exception("heartbeat failed")

    # --- which shards run here ----------------------------------------------------------

    async def _on_runner_state(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if isinstance(event, RunnerStateChanged) and event.node_id == self.node_id:
            self.supervisor.runner_state(event.runner_id, event.state)

    async def _on_placement_event(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return  # the projector dead-letters it; here it simply is no placement
        if isinstance(event, ModelRemoved) and (old := self.state.model(event.model_id)):
            files = [WeightFile.model_validate(f) for f in old.files or []]
            self._removed[event.model_id] = (files, event.ts)
        self.state.commit(changes_for(self.state, event))
        if msg.metadata.num_pending == 0:  # caught up: act on the latest picture only
            await self._reconcile()
            await self._forget_removed()

    async def _reconcile(self) -> None:
        desired = desired_runners(self.state, self.node_id)
        p = plan(desired, self.supervisor.runners)
        specs = {r: self._spec(row) for r, row in desired.items()}
        # A kept shard whose pipeline changed (a stage moved to another node) starts afresh,
        # so that it connects to the new stage.
        changed = {
            r
            for r, entry in self.supervisor.runners.items()
            if r in specs and specs[r] != entry.spec
        }
        for runner_id in p.stop | changed:
            stopped = self.supervisor.runners[runner_id].spec
            await self.supervisor.stop(runner_id)
            self.upkeep.cache.touch(stopped.model_id)  # used until now: the last use
        if p.start or changed:
            try:
                await self.upkeep.make_room(specs.values())
            except Exception:  # a cache that cannot be trimmed does not stop the runners
                log.exception("could not keep the weights cache within its budget")
        for runner_id in sorted(p.start | changed):
            spec = specs[runner_id]
            await self.supervisor.start(spec)
            await self._pub.publish(
                RunnerStateChanged(
                    runner_id=runner_id,
                    instance_id=spec.instance_id,
                    node_id=self.node_id,
                    state="Assigned",
                    origin=self.node_id,
                    pid=self.supervisor.pid(runner_id),
                )
            )

    async def _forget_removed(self) -> None:
        """Drop the files of the models removed since the last catch-up that are still removed
        and that no runner of this node uses (those are left to the budget)."""
        removed, self._removed = self._removed, {}
        in_use = {entry.spec.model_id for entry in self.supervisor.runners.values()}
        named = {
            str(f.get("sha256"))
            for model in self.state.models()
            for f in model.files or []
            if isinstance(f, dict)
        }
        for model_id, (files, removed_at) in removed.items():
            if self.state.model(model_id) is None and model_id not in in_use:
                try:
                    await self.upkeep.forget(model_id, files, removed_at, named)
                except OSError:
                    log.exception("could not delete the files of removed model %s", model_id)

    def _spec(self, row: RunnerRow) -> RunnerSpec:
        inst = self.state.instance(row.instance_id)
        assert inst is not None
        model = self.state.model(inst.model_id)
        shard = row.shard()
        peers = [
            r.shard()
            for r in self.state.runners_of(row.instance_id)
            if r.replica == row.replica and r.runner_id != row.runner_id
        ]
        return RunnerSpec(
            nats_url=self.config.nats_url,
            node_id=self.node_id,
            instance_id=row.instance_id,
            model_id=inst.model_id,
            shard=shard,
            role=inst.role,
            engine=main_engine(model.engines if model is not None else None),
            model_path=model.path if model is not None else None,
            files=[WeightFile.model_validate(f) for f in (model.files or [])] if model else [],
            source=model.source if model is not None else "",
            chat_format=model.chat_format if model is not None else None,
            # The context placement counted memory for.
            n_ctx=context_for(
                model.context_length if model is not None else 0, inst.context_length, inst.role
            ),
            n_threads=self.config.runner_threads,
            slots=runner_slots(inst.slots, self.config.slots),
            kv_cache=inst.kv_cache,
            speculative=(
                Speculative.model_validate(inst.speculative) if inst.speculative else None
            ),
            cache_dir=str(self.config.models_dir),
            peers=sorted(peers, key=lambda s: s.rank),
            data_host=self.data_host,
            task_file=str(self.config.data_dir / "logs" / f"runner-{row.runner_id}.task"),
        )

    # --- runner deaths ------------------------------------------------------------------

    async def _runner_exited(self, spec: RunnerSpec, code: int, restarting: bool) -> None:
        """A runner that died (``restarting``), or that was killed when it did not stop in time
        once asked to (it is Stopped then, as asked, and says why): the event it could not
        publish, and its tasks continued or failed."""
        cause = describe_exit(code)
        await self._pub.publish(
            RunnerStateChanged(
                runner_id=spec.runner_id,
                instance_id=spec.instance_id,
                node_id=self.node_id,
                state="Failed" if restarting else "Stopped",
                origin=self.node_id,
                exit_code=code,
                error=f"runner {cause}" + ("; restarting" if restarting else " (asked to stop)"),
            )
        )
        task_file = Path(spec.task_file) if spec.task_file else None
        left = CurrentTasks.read(task_file) if task_file is not None else []
        if task_file is not None:
            task_file.unlink(missing_ok=True)
        for task_id, model_id, attempt in left:
            # Continued from the log (resume.py), or failed where it cannot be.
            outcome: TaskCreated | TaskFailed
            try:
                logged = await read_logged(self._js, task_id, model_id)
                if superseded_since(logged, attempt):  # it was stalled: another runner has it
                    log.info("task %s: attempt %s was continued already", task_id, attempt)
                    continue
                outcome = continuation(
                    logged, runner_id=spec.runner_id, cause=cause, origin=self.node_id, at=utc_now()
                )
            except (nats.errors.Error, TimeoutError, ValidationError) as exc:
                log.warning("task %s: the log could not be read to resume it: %r", task_id, exc)
                outcome = TaskFailed(
                    task_id=task_id,
                    model_id=model_id,
                    origin=self.node_id,
                    runner_id=spec.runner_id,
                    error=f"the runner serving this task {cause}",
                    attempt=attempt,
                )
            log.info("task %s: %s", task_id, describe(outcome))
            await self._pub.publish(outcome, msg_id=message_id(outcome))


def _addresses() -> list[str]:
    out: list[str] = []
    for addrs in psutil.net_if_addrs().values():
        out += [a.address for a in addrs if a.family == socket.AF_INET]
    return out

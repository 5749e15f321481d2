"""`shoal up --ha` on three test hosts started at once: they find each other by the secret,
their NATS servers form one cluster with the log on all three, each serves the API from a
projection of its own; the host whose server leads the log dies, and the others go on serving,
saying what the log now tolerates."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from bus.cluster_secret import ENV as SECRET_ENV
from bus.connection import connect
from bus.log_replicas import replicas_up
from bus.nats_security import NatsSecurity
from bus.streams import EVENTS_STREAM
from events.catalogue import RunnerStateChanged
from harness.hosts import Host, Network
from harness.processes import SHOAL
from services.worker.identity import NODE_ID_FILE
from tests.bus.nats_cluster import make_leader
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

SECRET = "ha-test-secret-0123456789abcdef"
KEY = "ha-test-key"
QUESTION = "What is the capital city of France? Answer in one word."


def _node(host: Host) -> str:
    return (host.dir / "data" / "worker" / NODE_ID_FILE).read_text().strip()


def _log(host: Host) -> str:
    path = host.dir / "up.log"
    return path.read_text(errors="replace") if path.exists() else ""


async def _until(host: Host, text: str, timeout: float = 180) -> None:
    async with asyncio.timeout(timeout):
        while text not in _log(host):
            await asyncio.sleep(0.2)


def _chat(host: Host) -> str:
    body = json.dumps(
        {
            "model": "smollm2-135m",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}],
        }
    )
    url = "http://127.0.0.1:8000/v1/chat/completions"
    headers = ["-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}"]
    done = host.run(["curl", "-s", "--max-time", "120", url, *headers, "-d", body], timeout=150)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["choices"][0]["message"]["content"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("hosts", [3], indirect=True)
async def test_three_machines_hold_the_log_and_outlive_one(hosts: Network) -> None:
    env = {**os.environ, SECRET_ENV: SECRET, "SHOAL_WARM_RUNNER": "0"}
    for host in hosts.hosts:
        data = ["--data-dir", str(host.dir / "data")]
        argv = [SHOAL, "up", "--ha", *data, "--api-key", KEY, "--runner-threads", "1"]
        host.popen(argv, host.dir / "up.log", env, cwd=host.dir)
    try:
        for host in hosts.hosts:
            await _until(host, "ready:")
            await _until(host, "the log is on 3 servers, 3 up: it survives the loss of 1 more")
        first = hosts.hosts[0]
        security = NatsSecurity.from_env({SECRET_ENV: SECRET})
        nc = await connect(f"nats://{first.address}:4222", "ha-test", security=security)
        log = await EventLog().start(nc.jetstream())
        try:
            assert await replicas_up(nc.jetstream()) == (3, 3)
            assert "Paris" in await asyncio.to_thread(_chat, first)
            ready = await log.wait_for(RunnerStateChanged, lambda e: e.state == "Ready")
            # The host to lose: one that does not run the model, its server the log's leader
            # (each server is named after its node).
            victim = next(h for h in hosts.hosts[1:] if _node(h) != ready.node_id)
            await make_leader(nc, EVENTS_STREAM, _node(victim))
        finally:
            await log.stop()
            await nc.close()

        lost = time.monotonic()
        victim.kill()
        await _until(first, "the log is on 3 servers, 2 up: one more loss stops it", 60)
        # Each survivor's API answers, from a projection of its own.
        for host in hosts.hosts:
            if host is not victim:
                assert "Paris" in await asyncio.to_thread(_chat, host)
        print(f"a host of three lost: serving on after {time.monotonic() - lost:.1f} s")
        for host in hosts.hosts:
            assert "Consumer Deleted" not in _log(host)  # no projector took another's events
    finally:
        for host in hosts.hosts:
            sys.stdout.write(f"--- {host.name}\n{_log(host)[-2500:]}\n")

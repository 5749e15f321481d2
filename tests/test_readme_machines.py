"""The README's "One model over several machines", as printed, on test hosts with their own
addresses (``harness/hosts.py``): the commands are read from README.md and typed on each host.

- The first host runs `shoal up`, the second `shoal join` with no URL: it finds the first on
  the LAN by the secret. Each offers too little memory for SmolLM2 alone, so the model is split
  over the two, and the first host's API answers through both.
- A host with another secret on the same bridge does not join, and says why.
- A third host joins as the README's line for networks without multicast says (`--nats`).
- The second host's link is cut (a partition of the host holding a stage): the instance is
  placed again on the hosts left and answers again; the seconds that takes are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.cluster_secret import ENV as SECRET_ENV
from bus.connection import connect
from bus.nats_security import NatsSecurity
from events.catalogue import InstancePlaced, NodeJoined, RunnerStateChanged
from harness.hosts import Host, Network
from services.worker.identity import NODE_ID_FILE
from tests.cli.shoal_up import REPO
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

# SmolLM2 at 2048 tokens needs about 199 MiB: no host of these holds it alone, two do.
SPLIT = "--memory-limit 160M --runner-threads 1"
JOIN = f"{SPLIT} --heartbeat 1"  # a lost node noticed sooner
BIN = str(Path(sys.executable).parent)
QUESTION = "What is the capital city of France? Answer in one word."


def readme_machines(readme: str) -> list[str]:
    """The commands of the README's several-machines block, comments left out."""
    section = readme.split("## One model over several machines", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block is not None, "README.md's several-machines section has no ```sh block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line]


def _user_env(secret: str) -> dict[str, str]:
    """A user's shell: Shoal on the PATH, the exported secret, none of the suite's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env["SHOAL_WARM_RUNNER"] = "0"  # as the suite's other nodes: no idle spare per host
    return env | {SECRET_ENV: secret}


def _typed(host: Host, command: str, env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
    """``command`` typed in a shell on ``host``, in its own directory."""
    return host.popen(["bash", "-c", command], host.dir / f"{name}.log", env, cwd=host.dir)


async def _line(host: Host, name: str, prefix: str, timeout: float = 240) -> str:
    """The first line of a command's output that starts with ``prefix``."""
    log = host.dir / f"{name}.log"
    async with asyncio.timeout(timeout):
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            found = [x for x in text.splitlines() if x.startswith(prefix)]
            if found:
                return found[0]
            await asyncio.sleep(0.2)


def _chat(host: Host, env: dict[str, str], key: str) -> dict[str, object]:
    """A chat through the API on ``host``'s own loopback, as a user there would."""
    body = json.dumps(
        {
            "model": "smollm2-135m",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}],
        }
    )
    done = host.run(
        [
            "curl",
            "-s",
            "--max-time",
            "120",
            "http://127.0.0.1:8000/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-H",
            f"Authorization: Bearer {key}",
            "-d",
            body,
        ],
        timeout=150,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


def _node(host: Host, data: str) -> str:
    return (host.dir / data / NODE_ID_FILE).read_text().strip()


def test_the_block_is_found_whole() -> None:
    export, keys, up, join, explicit = readme_machines((REPO / "README.md").read_text())
    assert export.startswith(f"export {SECRET_ENV}=")
    assert keys.endswith("> KEYS") and "--api-key-file KEYS" in up
    assert up.startswith("shoal up") and join == "shoal join"
    assert explicit == "shoal join --nats nats://FIRST:4222"


@pytest.mark.timeout(600)
async def test_the_readme_s_machines_on_hosts_of_their_own(tmp_path: Path) -> None:
    export, keys, up, join, explicit = readme_machines((REPO / "README.md").read_text())
    secret = subprocess.run(
        ["bash", "-c", f'{export}; printf %s "${SECRET_ENV}"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    env = _user_env(secret)
    with Network(tmp_path, hosts=4) as net:
        first, second, third, stranger = net.hosts
        first.run(["bash", "-c", keys], env=env, cwd=first.dir, timeout=30)
        key = (first.dir / "KEYS").read_text().strip()
        _typed(first, f"{up} --data-dir data {SPLIT}", env, "up")
        join_line = await _line(first, "up", "join ")
        assert f"nats://{first.address}:4222" in join_line
        security = NatsSecurity.from_env({SECRET_ENV: secret})
        nc = await connect(f"nats://{first.address}:4222", "readme-test", security=security)
        log = await EventLog().start(nc.jetstream())
        try:
            _typed(second, f"{join} {JOIN}", env, "join")
            await _line(first, "up", "ready:")
            a, b = _node(first, "data/worker"), _node(second, "data/worker")
            joined = {e.node_id: e for e in log.of(NodeJoined)}
            # Each tells the others an address they reach it at, and why.
            assert joined[a].advertised == first.address, joined[a]
            assert "other machines may join" in joined[a].advertised_why
            assert joined[b].advertised == second.address, joined[b]
            assert f"route to NATS at {first.address}" in joined[b].advertised_why
            placed = log.of(InstancePlaced)[-1]
            assert {s.node_id for s in placed.shards} == {a, b}
            answer = await asyncio.to_thread(_chat, first, env, key)
            assert "Paris" in json.dumps(answer), answer

            # Another secret, the same bridge: it sees a cluster, not its own, and stays out.
            other = env | {SECRET_ENV: "another-secret-of-32-characters!"}
            apart = await asyncio.to_thread(
                stranger.run,
                ["bash", "-c", f"{join} --discover-timeout 6 {JOIN}"],
                60,
                other,
                stranger.dir,
            )
            assert apart.returncode == 1, apart.stdout + apart.stderr
            assert "no cluster with this secret answered" in apart.stderr
            assert "1 other cluster(s) answered" in apart.stderr
            assert not (stranger.dir / "data" / "worker" / NODE_ID_FILE).exists()

            # Where multicast does not pass: the URL, as the README prints it.
            typed = explicit.replace("FIRST", first.address)
            _typed(third, f"{typed} {JOIN}", env, "join-nats")
            await log.wait_for(NodeJoined, lambda e: e.advertised == third.address, 60)
            c = _node(third, "data/worker")
            assert {e.node_id for e in log.of(NodeJoined)} == {a, b, c}  # not the stranger

            # The second host is cut off: its stage is lost; placed again on the hosts left.
            cut = time.monotonic()
            second.partition()
            again = await log.wait_for(
                InstancePlaced, lambda e: (e.generation or 0) > (placed.generation or 0), 90
            )
            assert b not in {s.node_id for s in again.shards}
            await log.wait_for(
                RunnerStateChanged,
                lambda e: e.runner_id == again.shards[0].runner_id and e.state == "Ready",
                120,
            )
            answer = await asyncio.to_thread(_chat, first, env, key)
            assert "Paris" in json.dumps(answer), answer
            print(f"a stage's host partitioned: serving again after {time.monotonic() - cut:.1f} s")
        finally:
            await log.stop()
            await nc.close()
            for host in net.hosts:
                for log_file in sorted(host.dir.glob("*.log")):
                    tail = log_file.read_text(errors="replace")[-2500:]
                    sys.stdout.write(f"--- {host.name} {log_file.name}\n{tail}\n")

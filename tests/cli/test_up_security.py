"""`shoal up` locked down: NATS token and TLS, API keys and HTTPS; no secret ever shown."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from nats.js import JetStreamContext

from bus.connection import NatsUnavailable, connect
from bus.embedded import free_port
from bus.nats_security import NatsSecurity
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from bus.subjects import CHUNKS_PREFIX, EVENTS_PREFIX
from tests.certificates import make_certificates
from tests.cli.shoal_up import MODEL, read_until_ready, start, stop
from tests.services.processes import SHOAL

TOKEN = "nats-token-7f3a9c"
KEY = "api-key-5d1e8b"


def _up(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHOAL, "up", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("args", "env", "missing"),
    [
        (["--host", "0.0.0.0"], {}, "API keys (--api-key or SHOAL_API_KEYS) and NATS auth"),
        (["--host", "0.0.0.0", "--api-key", KEY], {}, "without NATS authentication"),
        (["--nats-host", "0.0.0.0"], {"SHOAL_NATS_TOKEN": TOKEN}, "without API keys"),
    ],
)
def test_up_refuses_to_listen_beyond_loopback_unlocked(
    tmp_path: Path, args: list[str], env: dict[str, str], missing: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_NATS_", "SHOAL_API"))}
    done = _up(["--data-dir", str(tmp_path), "--no-model", *args], clean | env)
    assert done.returncode == 1
    assert "refusing to listen on 0.0.0.0 without" in done.stderr and missing in done.stderr
    assert TOKEN not in done.stderr + done.stdout and KEY not in done.stderr + done.stdout
    assert not (tmp_path / "nats").exists()  # nothing was started


@pytest.mark.slow
async def test_a_locked_down_up_serves_and_never_shows_a_secret(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    data = tmp_path / "data"
    port = free_port("127.0.0.1")
    env = {"SHOAL_NATS_TOKEN": TOKEN, "SHOAL_NATS_CA": str(certs.ca), "SHOAL_API_KEYS": KEY}
    proc = start(
        [
            SHOAL,
            "up",
            "--data-dir",
            str(data),
            "--port",
            str(port),
            "--runner-threads",
            "1",
            "--tls-cert",
            str(certs.server_cert),
            "--tls-key",
            str(certs.server_key),
            "--nats-tls-cert",
            str(certs.server_cert),
            "--nats-tls-key",
            str(certs.server_key),
        ],
        env=env,
    )
    output: list[str] = []
    try:
        output += await read_until_ready(proc)
        text = "".join(output)
        assert f"https://127.0.0.1:{port}/v1 (API keys required)" in text
        assert "(token, TLS)" in text
        nats = re.search(r"^NATS\s+(\S+)", text, re.MULTILINE)
        assert nats is not None
        url = f"https://127.0.0.1:{port}/v1"
        question = {"role": "user", "content": "What is the capital of France? One word."}
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=certs.ca), timeout=60
        ) as client:
            answer = await client.post(
                f"{url}/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": MODEL, "messages": [question], "max_tokens": 8, "temperature": 0},
            )
            assert answer.status_code == 200, answer.text
            assert "Paris" in answer.json()["choices"][0]["message"]["content"]
            for header in ({}, {"Authorization": f"Bearer not-{KEY}"}):
                refused = await client.get(f"{url}/models", headers=header)
                assert refused.status_code == 401 and KEY not in refused.text
            assert (await client.get(f"https://127.0.0.1:{port}/healthz")).status_code == 200
        # NATS: without the token (or without trusting its CA), nothing gets in.
        for wrong in (
            NatsSecurity(tls_ca=certs.ca),
            NatsSecurity.from_env({"SHOAL_NATS_TOKEN": TOKEN}),
        ):
            with pytest.raises(NatsUnavailable) as refused_nats:
                await connect(nats.group(1), security=wrong, startup_timeout=5)
            assert TOKEN not in str(refused_nats.value)
        right = NatsSecurity.from_env({"SHOAL_NATS_TOKEN": TOKEN, "SHOAL_NATS_CA": str(certs.ca)})
        nc = await connect(nats.group(1), security=right)
        try:
            raw = await _everything_on_the_log(nc.jetstream())
        finally:
            await nc.close()
        assert any(b"ChunkGenerated" in m for m in raw)  # the chat's chunks are there
        for message in raw:
            assert TOKEN.encode() not in message and KEY.encode() not in message
    finally:
        rest = stop(proc)
        sys.stdout.write(rest[-2000:])
    output.append(rest)
    assert "stopped" in rest
    logs = [p for p in data.rglob("*") if p.is_file() and p.suffix in (".log", ".task", ".json")]
    assert any(p.name.startswith("runner-") for p in logs)  # the runners' logs were read too
    for text in ["".join(output), *(p.read_text(errors="replace") for p in logs)]:
        assert TOKEN not in text and KEY not in text


async def _everything_on_the_log(js: JetStreamContext) -> list[bytes]:
    """Every message of the events and chunks streams, raw."""
    return [
        msg.data
        for stream, prefix in ((EVENTS_STREAM, EVENTS_PREFIX), (CHUNKS_STREAM, CHUNKS_PREFIX))
        async for msg in read_stream(js, stream, f"{prefix}.>")
    ]

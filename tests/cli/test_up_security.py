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
from events.subjects import CHUNKS_PREFIX, EVENTS_PREFIX
from harness.processes import SHOAL
from harness.shoal_up import read_until_ready, start, stop
from tests.certificates import make_certificates
from tests.cli.shoal_up import MODEL

TOKEN = "nats-token-7f3a9c"
KEY = "api-key-5d1e8b"


def _up(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHOAL, "up", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("args", "env", "missing"),
    [
        (["--host", "0.0.0.0"], {}, "API keys (--api-key-file or SHOAL_API_KEYS) and NATS auth"),
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


def test_secrets_in_argv_are_warned_about_and_wildcards_refused_without_keys(
    tmp_path: Path,
) -> None:
    """Secrets given as options are in `ps`: said so, with the file forms; `*` for hosts or
    origins of a keyless API is refused (the class of Ollama's CVE-2024-28224)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_NATS_", "SHOAL_API"))}
    for wild in (["--allowed-host", "*"], ["--cors-origin", "*"]):
        done = _up(["--data-dir", str(tmp_path), "--no-model", *wild], clean)
        assert done.returncode == 1 and f"refusing {wild[0]} *" in done.stderr, done.stderr
    shown = subprocess.run(
        [SHOAL, "--nats-token", TOKEN, "api", "--api-key", KEY, "--port", "1", "--host", "1.2.3.4"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean,
    )
    assert "--nats-token puts a secret" in shown.stderr and "--nats-token-file" in shown.stderr
    assert "--api-key puts a secret" in shown.stderr and "--api-key-file" in shown.stderr
    assert TOKEN not in shown.stderr and KEY not in shown.stderr


@pytest.mark.slow
async def test_with_api_keys_the_loopback_nats_takes_a_token_of_its_own(tmp_path: Path) -> None:
    """Once, any local user could publish `KeyAdded role=admin` on the loopback NATS of a
    `shoal up` whose API had keys, or read every answer on `shoal.chunks.>`."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    data = tmp_path / "data"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_NATS_", "SHOAL_API"))}
    port = free_port("127.0.0.1")
    up = ["--data-dir", str(data), "--port", str(port), "--no-model", "--api-key-file", str(keys)]
    proc = start([SHOAL, "up", *up], env=clean)
    try:
        text = "".join(await read_until_ready(proc))
        nats = re.search(r"^NATS\s+(\S+) \(token, no TLS\)", text, re.MULTILINE)
        assert nats is not None, text
        token = data / "nats" / "token"
        assert token.stat().st_mode & 0o777 == 0o600 and token.read_text().strip() not in text
        with pytest.raises(NatsUnavailable):  # someone without it
            await connect(nats.group(1), security=NatsSecurity(), startup_timeout=5)
        nc = await connect(nats.group(1))  # this user: found in its run directory
        await nc.close()
        made = subprocess.run(
            [
                SHOAL,
                "keys",
                "add",
                "alice",
                "--nats",
                nats.group(1),
                "--db",
                f"sqlite:///{data / 'shoal.db'}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean,
        )
        assert made.returncode == 0 and made.stdout.startswith("sk-shoal-"), made.stderr
    finally:
        stop(proc)

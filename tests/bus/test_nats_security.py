"""NATS authentication and TLS: settings from the environment, and real nats-servers that
demand them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import nkeys  # type: ignore[import-untyped]
import pytest

from bus.connection import NatsUnavailable, connect
from bus.embedded import EmbeddedNats
from bus.nats_security import NatsSecurity, NatsSecurityError, redact_url
from bus.streams import ensure_streams
from harness.processes import SHOAL
from tests.bus.nats_operator import make_operator
from tests.certificates import make_certificates

TOKEN = "s3cret-token-value"
PASSWORD = "pa55-word-value"


def nkey_seed_file(directory: Path) -> Path:
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = directory / "user.nk"
    path.write_bytes(seed)
    return path


# --- settings -----------------------------------------------------------------------------


def test_settings_come_from_the_environment() -> None:
    security = NatsSecurity.from_env({"SHOAL_NATS_USER": "shoal", "SHOAL_NATS_PASSWORD": "pw"})
    assert security.authenticates and not security.tls
    assert security.connect_options() == {"user": "shoal", "password": "pw"}
    assert NatsSecurity.from_env({}).connect_options() == {}


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"SHOAL_NATS_TOKEN": "t", "SHOAL_NATS_USER": "u", "SHOAL_NATS_PASSWORD": "p"},
            "SHOAL_NATS_TOKEN and SHOAL_NATS_USER are set; use one of them",
        ),
        ({"SHOAL_NATS_USER": "u"}, "SHOAL_NATS_USER and SHOAL_NATS_PASSWORD go together"),
        ({"SHOAL_NATS_CERT": "/etc/hostname"}, "SHOAL_NATS_CERT and SHOAL_NATS_KEY go together"),
        ({"SHOAL_NATS_NKEY": "/no/such/seed"}, "SHOAL_NATS_NKEY: no such file: /no/such/seed"),
    ],
)
def test_settings_that_cannot_work_say_which(env: dict[str, str], says: str) -> None:
    with pytest.raises(NatsSecurityError, match=says):
        NatsSecurity.from_env(env)


def test_secrets_never_show_in_descriptions_or_reprs() -> None:
    security = NatsSecurity.from_env({"SHOAL_NATS_USER": "u", "SHOAL_NATS_PASSWORD": PASSWORD})
    assert PASSWORD not in repr(security) and PASSWORD not in security.describe()
    assert security.describe() == "user u, no TLS"
    token = NatsSecurity.from_env({"SHOAL_NATS_TOKEN": TOKEN})
    assert TOKEN not in repr(token) and token.describe() == "token, no TLS"


def test_urls_are_shown_without_their_credentials() -> None:
    assert redact_url("nats://u:pw@h:4222,nats://TOK@g:4223,nats://k:1") == (
        "nats://u:***@h:4222,nats://***@g:4223,nats://k:1"
    )


def test_the_embedded_server_admits_exactly_the_configured_credentials(tmp_path: Path) -> None:
    seed = nkey_seed_file(tmp_path)
    public = nkeys.from_seed(bytearray(seed.read_bytes())).public_key.decode()
    block = NatsSecurity(nkey_seed_file=seed).server_authorization()
    assert block == f"authorization {{ users: [ {{ nkey: {public} }} ] }}\n"
    quoted = NatsSecurity.from_env({"SHOAL_NATS_TOKEN": 'a"b'}).server_authorization()
    assert quoted == 'authorization { token: "a\\"b" }\n'


# --- real servers -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["token", "user", "nkey"])
async def test_a_server_with_authentication_admits_only_the_right_credentials(
    tmp_path: Path, method: str
) -> None:
    if method == "token":
        right = NatsSecurity.from_env({"SHOAL_NATS_TOKEN": TOKEN})
        wrong = NatsSecurity.from_env({"SHOAL_NATS_TOKEN": "not-" + TOKEN})
    elif method == "user":
        right = NatsSecurity.from_env({"SHOAL_NATS_USER": "u", "SHOAL_NATS_PASSWORD": PASSWORD})
        wrong = NatsSecurity.from_env({"SHOAL_NATS_USER": "u", "SHOAL_NATS_PASSWORD": "x"})
    else:
        right = NatsSecurity(nkey_seed_file=nkey_seed_file(tmp_path))
        (tmp_path / "other").mkdir()
        wrong = NatsSecurity(nkey_seed_file=nkey_seed_file(tmp_path / "other"))
    with EmbeddedNats(tmp_path / "nats", security=right) as server:
        config = (tmp_path / "nats" / "nats-server.conf").stat()
        assert config.st_mode & 0o077 == 0  # the secret's file is the owner's alone
        nc = await connect(server.url, security=right)
        await ensure_streams(nc.jetstream())
        await nc.close()
        for bad in (wrong, NatsSecurity()):
            with pytest.raises(NatsUnavailable, match="refused the credentials") as caught:
                await connect(server.url, security=bad, startup_timeout=5)
            assert TOKEN not in str(caught.value) and PASSWORD not in str(caught.value)


async def test_a_server_with_tls_is_reached_only_by_clients_that_trust_it(
    tmp_path: Path,
) -> None:
    certs = make_certificates(tmp_path / "certs")
    trusting = NatsSecurity(tls_ca=certs.ca)
    with EmbeddedNats(
        tmp_path / "nats", tls_cert=certs.server_cert, tls_key=certs.server_key
    ) as server:
        nc = await connect(server.url, security=trusting)
        await ensure_streams(nc.jetstream())
        assert nc.connected_url is not None
        await nc.close()
        # The system's CAs do not know this one: the handshake fails, and says so.
        with pytest.raises(NatsUnavailable, match="TLS"):
            await connect(server.url, security=NatsSecurity(), startup_timeout=5)


async def test_mutual_tls_wants_a_client_certificate(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    mutual = NatsSecurity(tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key)
    with EmbeddedNats(
        tmp_path / "nats", security=mutual, tls_cert=certs.server_cert, tls_key=certs.server_key
    ) as server:
        nc = await connect(server.url, security=mutual)
        await nc.close()
        with pytest.raises(NatsUnavailable):
            await connect(server.url, security=NatsSecurity(tls_ca=certs.ca), startup_timeout=5)


async def test_a_credentials_file_is_admitted_by_a_server_in_operator_mode(tmp_path: Path) -> None:
    operator = make_operator(tmp_path / "nsc")
    with EmbeddedNats(tmp_path / "nats", config=operator.server_config) as server:
        nc = await connect(server.url, security=NatsSecurity(creds_file=operator.creds_file))
        await ensure_streams(nc.jetstream())  # JetStream works in the user's account
        await nc.close()
        with pytest.raises(NatsUnavailable, match="refused the credentials"):
            await connect(server.url, security=NatsSecurity(), startup_timeout=5)
        # Every command takes the file as an option (which sets SHOAL_NATS_CREDS).
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_NATS_")}
        done = subprocess.run(
            [
                SHOAL,
                "--nats-creds",
                str(operator.creds_file),
                "events",
                "dump",
                "--nats",
                server.url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        refused = subprocess.run(
            [SHOAL, "events", "dump", "--nats", server.url],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert refused.returncode == 1 and "refused the credentials" in refused.stderr

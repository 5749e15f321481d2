"""Decentralised NATS authentication for tests: an operator, a system account, an account with
JetStream, and a user whose credentials file (JWT + seed) Shoal connects with.

What `nsc` would make, built with nkeys: each JWT is ``header.claims.signature`` (base64url),
signed with the issuer's ed25519 nkey. The server trusts the operator and is given the
accounts' JWTs in memory (``resolver: MEMORY``)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys  # type: ignore[import-untyped]

_UNLIMITED = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
}


@dataclass(frozen=True)
class Operator:
    server_config: str  # the operator, system account and resolver lines of nats-server.conf
    creds_file: Path  # the user's credentials


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> tuple[Any, bytes]:
    seed: bytes = nkeys.encode_seed(os.urandom(32), prefix)
    return nkeys.from_seed(bytearray(seed)), seed


def _public(key: Any) -> str:
    public: bytes = key.public_key
    return public.decode()


def _jwt(issuer: Any, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": _public(issuer),
        "name": name,
        "sub": subject,
        "nats": nats | {"version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    signed = f"{header}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def make_operator(directory: Path) -> Operator:
    directory.mkdir(parents=True, exist_ok=True)
    operator, _ = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    system, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    account, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user, user_seed = _keypair(nkeys.PREFIX_BYTE_USER)
    operator_jwt = _jwt(operator, _public(operator), "shoal-test", {"type": "operator"})
    system_jwt = _jwt(operator, _public(system), "SYS", {"type": "account"})
    account_jwt = _jwt(
        operator, _public(account), "shoal", {"type": "account", "limits": _UNLIMITED}
    )
    user_jwt = _jwt(
        account,
        _public(user),
        "shoal-user",
        {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1},
    )
    creds = directory / "user.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n"
    )
    config = (
        f'operator: "{operator_jwt}"\n'
        f"system_account: {_public(system)}\n"
        "resolver: MEMORY\n"
        f'resolver_preload: {{ {_public(system)}: "{system_jwt}",'
        f' {_public(account)}: "{account_jwt}" }}\n'
    )
    return Operator(config, creds)

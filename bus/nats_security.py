"""How a Shoal process proves who it is to NATS, and how it secures the connection.

Every process reads the same environment variables, so that a worker's runners, started by the
worker, inherit them; the ``shoal`` command's options (``--nats-token`` ...) only set these
variables. Secrets stay out of URLs, command lines, events and logs: ``describe()`` names the
method, never the secret, and ``redact_url`` strips credentials from a URL before it is shown.

| variable | meaning |
|---|---|
| ``SHOAL_NATS_TOKEN`` | token authentication |
| ``SHOAL_CLUSTER_SECRET`` | the cluster's secret: the token, unless another method is set |
| ``SHOAL_NATS_USER`` / ``SHOAL_NATS_PASSWORD`` | user and password |
| ``SHOAL_NATS_NKEY`` | path of a file holding an nkey seed (``SU...``) |
| ``SHOAL_NATS_CREDS`` | path of a credentials file (JWT and seed, decentralised auth) |
| ``SHOAL_NATS_CA`` | CA certificate to verify the server with (turns TLS on) |
| ``SHOAL_NATS_CERT`` / ``SHOAL_NATS_KEY`` | client certificate and key (mutual TLS) |
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr

from bus.cluster_secret import ENV as SECRET_ENV
from bus.cluster_secret import ClusterSecret, WeakSecret

ENV = {
    "token": "SHOAL_NATS_TOKEN",
    "user": "SHOAL_NATS_USER",
    "password": "SHOAL_NATS_PASSWORD",
    "nkey_seed_file": "SHOAL_NATS_NKEY",
    "creds_file": "SHOAL_NATS_CREDS",
    "tls_ca": "SHOAL_NATS_CA",
    "tls_cert": "SHOAL_NATS_CERT",
    "tls_key": "SHOAL_NATS_KEY",
}


class NatsSecurityError(ValueError):
    """Settings that cannot work together, or a file that cannot be read; says which."""


@dataclass(frozen=True)
class NatsSecurity:
    """Read from the environment in each process (it never crosses a process boundary but
    through the environment). Secrets are ``SecretStr``: a repr or a log line shows ``***``."""

    token: SecretStr | None = None
    user: str | None = None
    password: SecretStr | None = None
    nkey_seed_file: Path | None = None
    creds_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        methods = [m for m in ("token", "user", "nkey_seed_file", "creds_file") if getattr(self, m)]
        if len(methods) > 1:
            names = " and ".join(ENV[m] for m in methods)
            raise NatsSecurityError(f"NATS authentication: {names} are set; use one of them")
        if (self.user is None) != (self.password is None):
            raise NatsSecurityError(
                "NATS authentication: SHOAL_NATS_USER and SHOAL_NATS_PASSWORD go together"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise NatsSecurityError("NATS TLS: SHOAL_NATS_CERT and SHOAL_NATS_KEY go together")
        for name in ("nkey_seed_file", "creds_file", "tls_ca", "tls_cert", "tls_key"):
            path: Path | None = getattr(self, name)
            if path is not None and not path.is_file():
                raise NatsSecurityError(f"{ENV[name]}: no such file: {path}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NatsSecurity:
        source = os.environ if env is None else env

        def get(field: str) -> str | None:
            return source.get(ENV[field]) or None

        def path(field: str) -> Path | None:
            value = get(field)
            # Absolute: the variables are inherited by runners and read by a nats-server.
            return Path(value).expanduser().absolute() if value else None

        token, password = get("token"), get("password")
        secret = source.get(SECRET_ENV)
        if secret and not (token or get("user") or get("nkey_seed_file") or get("creds_file")):
            try:
                token = ClusterSecret(secret).nats_token
            except WeakSecret as exc:
                raise NatsSecurityError(f"{SECRET_ENV}: {exc}") from None
        return cls(
            token=SecretStr(token) if token else None,
            user=get("user"),
            password=SecretStr(password) if password else None,
            nkey_seed_file=path("nkey_seed_file"),
            creds_file=path("creds_file"),
            tls_ca=path("tls_ca"),
            tls_cert=path("tls_cert"),
            tls_key=path("tls_key"),
        )

    @property
    def authenticates(self) -> bool:
        return bool(self.token or self.user or self.nkey_seed_file or self.creds_file)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def describe(self) -> str:
        """The method, for a log line or an error message (never the secret)."""
        method = (
            "token"
            if self.token
            else f"user {self.user}"
            if self.user
            else "nkey"
            if self.nkey_seed_file
            else "credentials file"
            if self.creds_file
            else "no authentication"
        )
        return f"{method}, {'TLS' if self.tls else 'no TLS'}"

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's ``Client.connect``."""
        options: dict[str, Any] = {}
        if self.token:
            options["token"] = self.token.get_secret_value()
        if self.user and self.password:
            options["user"] = self.user
            options["password"] = self.password.get_secret_value()
        if self.nkey_seed_file:
            options["nkeys_seed"] = str(self.nkey_seed_file)
        if self.creds_file:
            options["user_credentials"] = str(self.creds_file)
        if self.tls:
            options["tls"] = self.ssl_context()
        return options

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(
            cafile=str(self.tls_ca) if self.tls_ca is not None else None
        )
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return context

    def server_authorization(self) -> str:
        """The ``authorization`` block of a nats-server configuration that admits exactly these
        credentials (for the embedded server of ``shoal up``)."""
        if self.token:
            return f"authorization {{ token: {_quoted(self.token.get_secret_value())} }}\n"
        if self.user and self.password:
            secret = _quoted(self.password.get_secret_value())
            return f"authorization {{ user: {_quoted(self.user)}, password: {secret} }}\n"
        if self.nkey_seed_file:
            public = nkey_public_key(self.nkey_seed_file)
            return f"authorization {{ users: [ {{ nkey: {public} }} ] }}\n"
        if self.creds_file:
            raise NatsSecurityError(
                "the embedded nats-server cannot check a credentials file (that needs an"
                " operator set up with nsc); use a token, a user and password, or an nkey"
            )
        return ""


def nkey_public_key(seed_file: Path) -> str:
    """The user public key (``U...``) of the nkey seed in ``seed_file``."""
    import nkeys  # type: ignore[import-untyped]

    seed = seed_file.read_bytes().strip()
    try:
        public: bytes = nkeys.from_seed(bytearray(seed)).public_key
    except Exception as exc:  # nkeys raises its own errors, all "not a valid seed"
        raise NatsSecurityError(f"{seed_file}: not an nkey seed ({exc})") from exc
    return public.decode()


def _quoted(value: str) -> str:
    # nats-server's configuration accepts JSON strings.
    return json.dumps(value)


def redact_url(url: str) -> str:
    """``nats://user:secret@host:4222`` as ``nats://user:***@host:4222`` (each of a
    comma-separated list); a URL without credentials is returned as it is."""
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.password is None and split.username is None:
            parts.append(one.strip())
            continue
        # A lone user part (nats://TOKEN@host) is a token: hide it whole.
        who = f"{split.username}:***" if split.password is not None else "***"
        host = split.hostname or ""
        netloc = f"{who}@{host}" + (f":{split.port}" if split.port else "")
        parts.append(urlunsplit(split._replace(netloc=netloc)))
    return ",".join(parts)

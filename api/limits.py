"""What every request must pass before the API does any work for it: the guard at the edge.

FastAPI reads and parses a whole body before the dependencies that check the key run, and
nothing else bounds a body; under `shoal up` the API shares a process with the projector,
the planner and the worker, so one large or slow unauthenticated request could take the node
down. ``RequestGuard``, a pure ASGI middleware, answers first, in this order, each refusal in
the dialect's error shape (``api/errors.py``) and before any of the body is read:

1. the ``Host`` (400) and ``Origin`` (403) a browser's page would send (``api/hosts.py``);
2. on the public paths (health, the dashboard's files, the OpenAPI document), which need no
   key, any method but GET and HEAD (405) and any body at all (413): nothing is read there;
3. the API key, when the API has keys (401): who the request is (``api/keys.py``), kept for
   the route, which checks its role (``api/roles.py``, ``context.require_key``);
4. a ``Content-Length`` over the limit (413), a body that is not JSON (415);

then, the key known, it reads the body itself, answering 413 as soon as a streamed (chunked)
body passes the limit and 408 when the whole body has not come within the timeout, and refuses
JSON text holding a lone UTF-16 surrogate (400), which no event could store; a large body is
checked in a worker thread, so that the event loop (under `shoal up`, the projector's, the
planner's and the worker's too) never walks it. The app then gets the body in one message.
Headers are bounded by the HTTP protocol (``api/http_protocol.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import keys
from api.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY, ApiConfig
from api.errors import ApiError, dialect_of, error_response
from api.hosts import HostPolicy, host_allowed, host_policy, origin_allowed, parse_host
from api.keys import Principal
from api.roles import ROUTE_ROLES

log = logging.getLogger(__name__)

# Paths served without a key (api/roles.py's public routes: the health checks, the
# dashboard's page and files, FastAPI's OpenAPI document and its pages); any other needs one.
KEYLESS_PATHS = frozenset(path for (_, path), role in ROUTE_ROLES.items() if role == "public")
KEYLESS_PREFIXES = ("/static/",)
# Paths whose bodies are not JSON: Ollama's model files (/api/blobs, answered 501).
NOT_JSON_PREFIXES = ("/api/blobs/",)
# Methods whose bodies are checked for JSON (a GET's body, if any, is never read by a route).
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# The methods of the public paths: they read nothing, and take no body.
PUBLIC_METHODS = frozenset({"GET", "HEAD"})
# A body at least this large is checked for lone surrogates in a worker thread (json.loads of
# 32 MiB takes a second of the loop's time; of 64 KiB, well under a millisecond).
OFF_LOOP_BYTES = 64 * 1024

# A lone surrogate can reach a decoded string only as a \u escape (d800-dfff), as the UTF-8-like
# bytes of one (ED A0..BF ..), which json.loads decodes with 'surrogatepass', or in a UTF-16 or
# UTF-32 body.
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Host names refused, logged once each (a bounded set: a flood of names logs no more).
_LOGGED_HOSTS_MAX = 100


@dataclass(frozen=True)
class Limits:
    """What a request may be: the largest body, how long its body may take, which hosts and
    origins it may name, and the keys it needs."""

    max_body_bytes: int = DEFAULT_MAX_BODY
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    hosts: HostPolicy = field(default_factory=HostPolicy)
    cors_origins: tuple[str, ...] = ()
    api_keys: frozenset[str] = frozenset()


def limits_of(config: ApiConfig) -> Limits:
    """The limits an API process applies, from what it was told at start."""
    return Limits(
        max_body_bytes=config.max_body_bytes,
        body_timeout_s=config.body_timeout_s,
        hosts=host_policy(config.listen_hosts, config.allowed_hosts),
        cors_origins=config.cors_origins,
        api_keys=config.api_keys,
    )


def needs_key(path: str) -> bool:
    """Whether a request for ``path`` needs the API key (when keys are configured)."""
    return path not in KEYLESS_PATHS and not path.startswith(KEYLESS_PREFIXES)


def public_refusal(method: str, body: bool) -> ApiError | None:
    """The 405 of a public path asked with a method that is not GET or HEAD, or the 413 of a
    body sent to one: these paths need no key, so they read nothing anyone sends."""
    if method not in PUBLIC_METHODS:
        return ApiError(
            405,
            f"Method {method[:20]} is not allowed here: this path answers GET and HEAD only",
            code="method_not_allowed",
            headers={"Allow": "GET, HEAD"},
        )
    if body:
        return ApiError(
            413,
            "This path takes no request body (it needs no key, and reads nothing sent to it)",
            code="request_too_large",
        )
    return None


def has_body(headers: Headers) -> bool:
    """Whether a request comes with a body: a Content-Length above 0, or a chunked one."""
    if "transfer-encoding" in headers:
        return True
    length = headers.get("content-length")
    if length is None:
        return False
    text = length.strip()
    return not (text.isascii() and text.isdigit()) or int(text) > 0  # a bad one: refused


def length_refusal(content_length: str | None, limit: int) -> ApiError | None:
    """The 413 of a body announced larger than ``limit`` bytes (or a 400 for a length that is
    not one), before any of it is read; None when it may come."""
    if content_length is None:
        return None
    text = content_length.strip()
    if not (text.isascii() and text.isdigit()):
        return ApiError(400, f"Content-Length {text[:40]!r} is not a number of bytes")
    if int(text) > limit:
        return too_large(limit, int(text))
    return None


def too_large(limit: int, size: int | None = None) -> ApiError:
    """The 413 of a body over ``limit`` bytes (``size``: as announced, when it was)."""
    what = f"is {size} bytes" if size is not None else "is larger than that"
    return ApiError(
        413,
        f"The request body {what}: this API accepts at most {limit} bytes"
        " (`--max-body` of `shoal api` and `shoal up`)",
        code="request_too_large",
    )


def too_slow(timeout_s: float) -> ApiError:
    return ApiError(
        408,
        f"The request body did not arrive within {timeout_s:g} s"
        " (`--body-timeout` of `shoal api` and `shoal up`)",
        code="request_timeout",
    )


def content_type_refusal(
    method: str, path: str, content_type: str | None, body: bool
) -> ApiError | None:
    """The 415 of a body that does not say it is JSON, as every SDK's does: a page of another
    site could send a form's body (a "simple" request, without a preflight), never this. Only
    methods with bodies, and only when one is sent."""
    if not body or method not in BODY_METHODS or path.startswith(NOT_JSON_PREFIXES):
        return None
    media = (content_type or "").partition(";")[0].strip().lower()
    if media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    ):
        return None
    sent = f"`{media}`" if media else "none"
    return ApiError(
        415,
        f"The request body must be JSON, sent with `Content-Type: application/json` (this one"
        f" has {sent}; curl: -H 'Content-Type: application/json', or --json)",
        code="unsupported_media_type",
    )


def host_refusal(host: str | None, policy: HostPolicy) -> ApiError | None:
    """The 400 of a request addressed to a name this API does not answer to."""
    if host_allowed(host, policy):
        return None
    name = (host or "").strip()[:100]
    parsed = parse_host(name)
    return ApiError(
        400,
        f"This API does not answer to the host {name!r}: it answers to {policy.describe()}."
        f" If {name!r} names it (a name on your network, a proxy's), start it with"
        f" `--allowed-host {parsed[0] if parsed else 'NAME'}`",
        code="host_not_allowed",
    )


def origin_refusal(
    origin: str | None, host: str | None, cors_origins: Iterable[str]
) -> ApiError | None:
    """The 403 of a request sent by a web page of an origin neither the API's own nor given
    with --cors-origin."""
    if origin_allowed(origin, host, cors_origins):
        return None
    shown = (origin or "")[:200]
    return ApiError(
        403,
        f"Requests from web pages of {shown!r} are refused: only the API's own pages (the"
        " dashboard) and the origins given with `--cors-origin` may call it. To let that"
        f" page call it, start the API with `--cors-origin {shown}`",
        code="origin_not_allowed",
    )


def surrogate_refusal(body: bytes) -> ApiError | None:
    """The 400 of a JSON body whose text holds a lone UTF-16 surrogate (``"\\ud800"``): JSON
    allows the escape, but it is no character, and nothing that holds it can be encoded (an
    event, a prompt). Read only when the bytes hint at one (a pair, as in an escaped emoji, is
    fine)."""
    if not _could_hold_surrogate(body):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the route's own parsing says so
    where = _surrogate_at(value)
    if where is None:
        return None
    param = where or None
    prefix = f"{where}: " if where else ""
    return ApiError(
        400,
        f"{prefix}the text holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its"
        " pair), which is not a character: send valid Unicode",
        param=param,
    )


def _could_hold_surrogate(body: bytes) -> bool:
    """Whether decoding may find a lone surrogate: no for most bodies after two byte searches
    at memory speed; else the body is decoded to find out (an emoji escaped as a pair, as
    json.dumps writes it by default, is fine): JSON's C decoder is 20 times as fast as any
    pattern that would pair the escapes."""
    if 0 in body[:4]:
        return True  # UTF-16 or UTF-32 JSON
    if b"\\u" not in body and b"\xed" not in body:
        return False
    return _SURROGATE_HINT.search(body) is not None


def _surrogate_at(value: Any) -> str | None:
    """The path (``messages.0.content``; '' for the whole) of the first string, or key,
    holding a lone surrogate; None when none does. Iterative: depth costs no recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                where = f"{path}.{key}" if path else str(key)
                if not key.isascii() and _SURROGATE.search(key):
                    return path
                children.append((where, child))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(
                (f"{path}.{i}" if path else str(i), child)
                for i, child in reversed(list(enumerate(item)))
            )
    return None


class BodyTooLarge(Exception):
    """A body passed the limit as it was read."""


class ClientGone(Exception):
    """The client disconnected before its body was whole."""


async def read_body(receive: Receive, limit: int, deadline: float) -> bytes:
    """The whole body, read from ``receive``; ``BodyTooLarge`` as soon as it passes ``limit``
    bytes, ``TimeoutError`` when it is not whole by ``deadline`` (the loop's clock),
    ``ClientGone`` when the client left."""
    chunks: list[bytes] = []
    size = 0
    async with asyncio.timeout_at(deadline):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read, in one message, then the client's own (which
    says when it disconnects)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class RequestGuard:
    """The checks above, before the app (see the module's docstring)."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app = app
        self.limits = limits
        self._logged_hosts: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        body = has_body(headers)
        refused = self._address_refusal(headers)
        public = not needs_key(path)
        if refused is None and public:
            refused = public_refusal(scope["method"], body)
        if refused is None and not public:
            who = await self._principal(scope, headers)
            if isinstance(who, ApiError):
                refused = who
            else:  # for the route's role check and the serving path (its owner, its limits)
                scope.setdefault("state", {})["principal"] = who
                keys.PRINCIPAL.set(who)
        if refused is None:
            refused = self._body_refusal(scope, headers, body)
        if refused is not None:
            await self._refuse(refused, scope, receive, send, close=body)
            return
        if not body:
            await self.app(scope, receive, send)
            return
        # From the headers' end (uvicorn calls the app then): the whole body within the time.
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        try:
            data = await read_body(receive, self.limits.max_body_bytes, deadline)
        except ClientGone:
            return
        except BodyTooLarge:
            await self._refuse(too_large(self.limits.max_body_bytes), scope, receive, send, True)
            return
        except TimeoutError:
            await self._refuse(too_slow(self.limits.body_timeout_s), scope, receive, send, True)
            return
        if scope["method"] in BODY_METHODS and not path.startswith(NOT_JSON_PREFIXES):
            if len(data) < OFF_LOOP_BYTES:
                bad = surrogate_refusal(data)
            else:  # the loop serves every other request meanwhile
                bad = await asyncio.to_thread(surrogate_refusal, data)
            if bad is not None:
                await self._refuse(bad, scope, receive, send, close=False)
                return
        await self.app(scope, _replaying(data, receive), send)

    def _address_refusal(self, headers: Headers) -> ApiError | None:
        """The refusal of a request for a name, or from a page, this API does not serve."""
        host = headers.get("host")
        refused = host_refusal(host, self.limits.hosts)
        if refused is not None:
            self._log_host(host)
            return refused
        return origin_refusal(headers.get("origin"), host, self.limits.cors_origins)

    def _body_refusal(self, scope: Scope, headers: Headers, body: bool) -> ApiError | None:
        """The refusal of a body announced too large, or not JSON."""
        limits = self.limits
        path: str = scope["path"]
        if body:
            refused = length_refusal(headers.get("content-length"), limits.max_body_bytes)
            if refused is not None:
                return refused
        return content_type_refusal(scope["method"], path, headers.get("content-type"), body)

    async def _principal(self, scope: Scope, headers: Headers) -> Principal | ApiError:
        """Who the request is, from its key; the 401 when its key opens nothing."""
        given = keys.given_key(headers.get("authorization"), headers.get("x-api-key"))
        # The app's context, made by its lifespan (none: no keys made on the log to look up).
        ctx = getattr(getattr(scope.get("app"), "state", None), "ctx", None)
        try:
            made = await ctx.key_book.keys(ctx.engine, ctx.js) if ctx is not None else {}
        except ApiError as err:  # the keys cannot be read yet (outside the app's handlers)
            return err
        ever = ctx is not None and ctx.key_book.ever_made
        return keys.principal_or_refusal(given, self.limits.api_keys, made, ever)

    def _log_host(self, host: str | None) -> None:
        name = (host or "")[:100]
        if name in self._logged_hosts or len(self._logged_hosts) >= _LOGGED_HOSTS_MAX:
            return
        self._logged_hosts.add(name)
        log.warning(
            "refused a request for the host %r (DNS rebinding?); allowed: %s%s",
            name,
            ", ".join(sorted(self.limits.hosts.names)) or "loopback only",
            " and this machine's addresses" if self.limits.hosts.addresses else "",
        )

    async def _refuse(
        self, err: ApiError, scope: Scope, receive: Receive, send: Send, close: bool
    ) -> None:
        """Answer ``err`` in the dialect of the path; ``close``: the connection too, since
        the rest of the body is never read."""
        response = error_response(err, dialect_of(scope["path"]))
        if close:
            response.headers["connection"] = "close"
        await response(scope, receive, send)

"""An image fetched from an http(s) URL, for an API whose operator allows it
(``--allow-image-urls`` of ``shoal api`` and ``shoal up``; off by default: a client may then
send images only as data).

Fetching on a client's behalf would let it reach what the API can reach and it cannot (a
server-side request forgery), so the URL's host is resolved here and every address it resolves
to must be public: not loopback, private, link-local (cloud metadata, 169.254.169.254), shared
(100.64/10), multicast, reserved or unspecified, nor an IPv6 form of one (IPv4-mapped, NAT64,
6to4, Teredo). The connection is then made to the address that was checked, never resolved
again (a name that resolves anew to another address, DNS rebinding, is not asked twice); TLS
still checks the certificate against the host's name. A redirect is followed, ``MAX_REDIRECTS``
at most, only to a URL that passes the same checks. The body is read up to the image limit (a
413 as soon as it is over, or at once when its length says so), all within
``FETCH_TIMEOUT_S``.

The request is HTTP/1.0 (with ``Host``), so that the answer is never chunked and ends with the
connection: the few lines here are the whole client. No proxy is used.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from collections.abc import Callable
from urllib.parse import quote, urljoin, urlsplit

from api.images.inputs import ImageInput, refused

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
_READ_BYTES = 64 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# What may stand in a request's path unescaped (RFC 3986's path and query characters).
_SAFE = "/?#[]@!$&'()*+,;=-._~%:"

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
AddressCheck = Callable[[IpAddress], bool]

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def public_address(ip: IpAddress) -> bool:
    """Whether ``ip`` is an address of the public Internet (pure)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64:  # an IPv4 address, through a NAT64 gateway
            return public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None and not public_address(embedded):
            return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


async def checked_address(
    host: str, port: int, given: ImageInput, allowed: AddressCheck = public_address
) -> IpAddress:
    """The address to connect to for ``host``: every one it resolves to must be ``allowed``
    (a 400 naming the first that is not)."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise refused(400, f"the image URL's host {host!r} is not known", given) from None
    addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found]
    if not addresses:
        raise refused(400, f"the image URL's host {host!r} has no address", given)
    for ip in addresses:
        if not allowed(ip):
            raise refused(
                400,
                f"the image URL's host {host!r} is {ip}, not a public address: Shoal fetches"
                " images from the public Internet only",
                given,
            )
    return addresses[0]


async def fetch_image(
    given: ImageInput,
    max_bytes: int,
    *,
    allowed: AddressCheck = public_address,
    timeout_s: float = FETCH_TIMEOUT_S,
) -> bytes:
    """The bytes at ``given.url``, following redirects; an ``ApiError`` (400, or 413 past
    ``max_bytes``) naming the input otherwise."""
    assert given.url is not None
    url = given.url
    try:
        async with asyncio.timeout(timeout_s):
            for _ in range(MAX_REDIRECTS + 1):
                status, location, body = await _get(url, given, max_bytes, allowed)
                if status in _REDIRECTS and location:
                    url = urljoin(url, location)
                    continue
                if not 200 <= status < 300:
                    raise refused(400, f"fetching the image URL was answered {status}", given)
                if not body:
                    raise refused(400, "the image URL's answer is empty", given)
                return body
    except TimeoutError:
        raise refused(
            400, f"the image URL did not answer whole within {timeout_s:g} s", given
        ) from None
    raise refused(400, f"the image URL redirects more than {MAX_REDIRECTS} times", given)


async def _get(
    url: str, given: ImageInput, max_bytes: int, allowed: AddressCheck
) -> tuple[int, str | None, bytes]:
    """One GET of ``url``: its status, its ``Location`` and (for a 2xx) its body."""
    split = urlsplit(url)
    scheme = split.scheme.lower()
    if scheme not in ("http", "https") or not split.hostname:
        raise refused(400, f"an image URL is http(s), with a host, not {url[:60]!r}", given)
    try:
        port = split.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise refused(400, "the image URL's port is not a number", given) from None
    host = split.hostname
    ip = await checked_address(host, port, given, allowed)
    named = f"[{host}]" if ":" in host else host
    if split.port is not None:
        named += f":{split.port}"
    target = quote(split.path or "/", safe=_SAFE) + (
        f"?{quote(split.query, safe=_SAFE)}" if split.query else ""
    )
    request = (
        f"GET {target} HTTP/1.0\r\nHost: {named}\r\nUser-Agent: shoal\r\n"
        "Accept: image/*\r\nConnection: close\r\n\r\n"
    )
    try:
        reader, writer = await asyncio.open_connection(
            str(ip),
            port,
            ssl=_tls() if scheme == "https" else None,
            server_hostname=host if scheme == "https" else None,
        )
    except OSError as exc:
        raise refused(400, f"the image URL could not be reached ({exc})", given) from None
    try:
        writer.write(request.encode("ascii"))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = _head(head)
        if not 200 <= status < 300:
            return status, headers.get("location"), b""
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise refused(413, _too_large(f"{length} bytes", max_bytes), given)
        body = bytearray()
        while chunk := await reader.read(_READ_BYTES):
            body += chunk
            if len(body) > max_bytes:
                raise refused(413, _too_large("larger", max_bytes), given)
        return status, None, bytes(body)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise refused(400, f"the image URL's answer could not be read ({exc!r})", given) from None
    finally:
        writer.close()


def _head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status and the headers (names in lower case) of an answer's head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP answer: {lines[0][:60]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _too_large(size: str, max_bytes: int) -> str:
    return f"the image at the URL is {size}, more than the {max_bytes} bytes an image may be here"

"""Fetching an image over http(s) without letting a client aim the server at anything else.

Every hop (the first URL and each redirect) is checked the same way before a byte is sent:
the scheme is http or https (no https -> http downgrade), the host is one of
`--allowed-media-domains`, and every address the host resolves to is a public one unless
`--allow-private-media` (link-local, multicast and unspecified addresses are refused even then:
169.254.169.254 is the cloud metadata service). The connection then goes to the checked
address itself, so a second DNS answer cannot swap in another one (TLS still verifies the
host name). One deadline covers the whole fetch, name resolution (a resolver that never answers),
redirects and a slow body included; the body
is capped in bytes and must be declared as a PNG, JPEG or WebP image.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_READ_CHUNK = 64 * 1024
# getaddrinfo cannot be interrupted, so a lookup past the deadline is abandoned to its thread;
# this bounds how many such threads hostile host names can leave behind at once.
MAX_CONCURRENT_LOOKUPS = 16
_lookups = threading.BoundedSemaphore(MAX_CONCURRENT_LOOKUPS)


class MediaFetchError(ValueError):
    """A refused or failed fetch; the message is safe to return to the client (a 400)."""


@dataclass(frozen=True)
class FetchRules:
    """The operator's rules for remote media (from `MediaPolicy`)."""

    allowed_domains: frozenset[str]
    allowed_mime_types: frozenset[str]
    max_bytes: int
    timeout_s: float = 10.0
    max_redirects: int = 3
    allow_private: bool = False


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent in the request line


def fetch_remote(url: str, rules: FetchRules) -> bytes:
    """The body at `url` (redirects followed and re-checked), or raise MediaFetchError."""
    deadline = time.monotonic() + rules.timeout_s
    previous: _Target | None = None
    for _ in range(rules.max_redirects + 1):
        target = _check_url(url, rules, previous)
        address = _checked_address(target, rules, deadline)
        status, location, body = _get(target, address, rules, deadline)
        if status not in REDIRECT_STATUSES:
            return body
        if not location:
            raise MediaFetchError(f"The image host {target.host} answered {status} with no "
                                  "Location")
        url, previous = urllib.parse.urljoin(url, location), target
    raise MediaFetchError(f"The image URL redirected more than {rules.max_redirects} times "
                          "(--max-media-redirects)")


def _check_url(url: str, rules: FetchRules, previous: _Target | None) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaFetchError(f"Malformed image URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaFetchError(f"An image URL redirected to the refused scheme '{scheme}:'")
    if previous is not None and previous.scheme == "https" and scheme == "http":
        raise MediaFetchError("An https image URL redirected to plain http; refused")
    host = (parts.hostname or "").lower()
    if host not in rules.allowed_domains:
        if previous is not None:
            raise MediaFetchError(f"The image URL redirected to host '{host}', which "
                                  "--allowed-media-domains does not list; refused")
        raise MediaFetchError(
            f"Remote image URLs are refused (host '{host}'): send the image as a data URL, or "
            "start the server with --allowed-media-domains to allow this host")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return _Target(scheme, host, port or (443 if scheme == "https" else 80), path)


def is_refused_address(address: str, allow_private: bool) -> bool:
    """Whether a resolved address may not be fetched from."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return True
    return not (ip.is_global or allow_private)


def _resolve(target: _Target, rules: FetchRules, deadline: float) -> list:
    """getaddrinfo on a thread, waited for until the fetch's deadline at most."""
    if not _lookups.acquire(timeout=_remaining(deadline, rules)):
        raise MediaFetchError(f"Too many image host lookups in progress; resolving "
                              f"{target.host} did not start within {rules.timeout_s:g} s")
    result: dict = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            result["infos"] = socket.getaddrinfo(target.host, target.port,
                                                 type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            result["error"] = exc
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=lookup, name="media-dns", daemon=True).start()
    if not done.wait(_remaining(deadline, rules)):
        raise MediaFetchError(f"Resolving the image host {target.host} took longer than "
                              f"{rules.timeout_s:g} s (--media-fetch-timeout)")
    if "error" in result:
        raise MediaFetchError(f"Could not resolve the image host {target.host}: "
                              f"{result['error']}")
    return result["infos"]


def _checked_address(target: _Target, rules: FetchRules, deadline: float) -> str:
    """The address to connect to: every address of the host must pass (a host that answers
    with one public and one private address could be steered to either)."""
    infos = _resolve(target, rules, deadline)
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        if is_refused_address(address, rules.allow_private):
            raise MediaFetchError(
                f"The image host {target.host} resolves to {address}, which is not a public "
                "address (start the server with --allow-private-media to allow private and "
                "loopback addresses)")
    if not addresses:
        raise MediaFetchError(f"The image host {target.host} has no address")
    return addresses[0]


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to `address` (already checked) while naming `host` in the request."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _remaining(deadline: float, rules: FetchRules) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaFetchError(f"Fetching the image took longer than {rules.timeout_s:g} s "
                              "(--media-fetch-timeout)")
    return left


def _get(target: _Target, address: str, rules: FetchRules, deadline: float,
         ) -> tuple[int, str | None, bytes]:
    cls = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    conn = cls(target.host, target.port, address, _remaining(deadline, rules))
    # Per-read timeouts alone let a server drip one byte per timeout forever: at the deadline
    # the socket is shut, which ends any read in progress.
    watchdog = threading.Timer(_remaining(deadline, rules), _shut, args=(conn,))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("GET", target.path, headers={
            "Accept": ", ".join(sorted(rules.allowed_mime_types)),
            "User-Agent": "deepinfer-media-fetch"})
        response = conn.getresponse()
        if response.status in REDIRECT_STATUSES:
            return response.status, response.getheader("Location"), b""
        if response.status != 200:
            raise MediaFetchError(f"The image host {target.host} answered HTTP "
                                  f"{response.status}")
        _check_headers(response, target, rules)
        return 200, None, _read_body(conn, response, rules, deadline)
    except (OSError, http.client.HTTPException) as exc:
        _remaining(deadline, rules)  # a read ended by the watchdog: say so
        raise MediaFetchError(f"Could not fetch the image from {target.host}: {exc}") from None
    finally:
        watchdog.cancel()
        conn.close()


def _check_headers(response, target: _Target, rules: FetchRules) -> None:
    mime = (response.getheader("Content-Type") or "").split(";", 1)[0].strip().lower()
    if mime not in rules.allowed_mime_types:
        raise MediaFetchError(f"The image at {target.host} has content type "
                              f"'{mime or '(none)'}'; expected one of "
                              f"{', '.join(sorted(rules.allowed_mime_types))}")
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > rules.max_bytes:
        raise MediaFetchError(f"The image at {target.host} is larger than {rules.max_bytes} "
                              "bytes")


def _read_body(conn, response, rules: FetchRules, deadline: float) -> bytes:
    chunks, size = [], 0
    while True:
        left = _remaining(deadline, rules)
        if conn.sock is not None:
            conn.sock.settimeout(left)
        chunk = response.read1(_READ_CHUNK)  # returns after one receive, unlike read(n)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > rules.max_bytes:
            raise MediaFetchError(f"The image is larger than {rules.max_bytes} bytes")
        chunks.append(chunk)


def _shut(conn) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

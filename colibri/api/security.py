"""The HTTP server's guards: API key, bind policy, Host header (DNS rebinding), CORS, the Origin
and Content-Type rules that keep foreign web pages out, and HTTP/1.1 framing.

Pure functions of configuration and header values, so each rule is testable without a server.
Header strings are as the ASGI stack hands them over: decoded as latin-1.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable

from colibri.errors import ColibriError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # the names a local browser uses for this machine

# The Vite dev server (web/) and Tauri's local origins on macOS/Linux and Windows (api.md).
DEFAULT_CORS_ORIGINS = (
    "http://localhost:5173",
    "http://127.0.0.1:5173",
    "tauri://localhost",
    "http://tauri.localhost",
    "https://tauri.localhost",
)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = ("authorization", "content-type", "x-api-key")  # what the server itself reads
CORS_EXPOSE = "x-colibri-queue-wait-ms"  # so the web UI can show queue wait
# Short enough that a changed --cors-origin takes effect soon; browsers cap it anyway (Chromium: 2 h).
CORS_MAX_AGE_S = 600
# Bound the preflight answer: a real client requests a handful (the OpenAI SDK ~10 x-stainless-*).
MAX_REQUESTED_HEADERS = 32

# A POST body must say it is JSON: a cross-origin page can send text/plain, form or multipart
# bodies without a CORS preflight, but not application/json.
JSON_MEDIA_TYPE = "application/json"
# The ports an Origin without one means, for the schemes whose pages may be the server's own.
DEFAULT_PORTS = {"http": 80, "https": 443}

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")  # an RFC 9110 header name, length-bounded
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")  # scheme://host[:port], no path


# --- API key -----------------------------------------------------------------------------------


def _key_bytes(presented: str) -> set[bytes]:
    """The bytes a header value may stand for.

    The ASGI stack decodes headers as latin-1, so a UTF-8 key arrives as mojibake whose latin-1
    encoding restores the bytes sent; a str built by other code is taken as text (UTF-8).
    """
    out = {presented.encode("utf-8")}
    try:
        out.add(presented.encode("latin-1"))
    except UnicodeEncodeError:
        pass
    return out


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None  # auth schemes are case-insensitive


def check_api_key(expected: str | None, authorization: str | None, x_api_key: str | None) -> bool:
    """Whether the request carries the key (``Authorization: Bearer`` or ``x-api-key``).

    True when no key is configured; an empty key counts as none (``COLI_API_KEY=`` must not make the
    empty string a password). Compared in constant time so response timing leaks nothing of the key.
    """
    if not expected:
        return True
    want = expected.encode("utf-8")
    ok = False
    for presented in (_bearer(authorization), x_api_key.strip() if x_api_key else None):
        if not presented:
            continue
        for candidate in _key_bytes(presented):
            ok |= hmac.compare_digest(candidate, want)  # no short-circuit: every candidate is compared
    return ok


# --- bind address --------------------------------------------------------------------------------


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    except ValueError:
        return None


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    ip = _ip(h)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is not None and ip.is_loopback


def require_key_for_bind(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse to expose an unauthenticated server beyond this machine unless told to."""
    if insecure or api_key or is_loopback_host(host):
        return
    raise ColibriError(
        f"refusing to listen on {host} without an API key: anyone who can reach it could use the model. "
        "Set COLI_API_KEY, bind 127.0.0.1, or pass --insecure on a trusted network"
    )


# --- Host header -----------------------------------------------------------------------------------


def split_host(value: str) -> tuple[str, int | None] | None:
    """``(name, port)`` from a Host header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``), or None.

    The name is lowercased and an IPv6 literal loses its brackets; anything malformed is None.
    """
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            return None
        name, rest = v[1:end], v[end + 1 :]
        if not isinstance(_ip(name), ipaddress.IPv6Address):
            return None
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] if rest else None
    else:
        name, sep, port = v.partition(":")
        if not sep:
            port = None
        if ":" in (port or ""):
            return None  # a bare IPv6 address: the Host grammar requires brackets
    if not name or any(c in name for c in "@/\\ \t"):
        return None
    if port is None:
        return name, None
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) <= 65535):
        return None
    return name, int(port)


class HostGuard:
    """DNS-rebinding defence: on a loopback bind, accept only Host headers naming this machine.

    A rebinding page at ``http://evil.com:8000`` reaches 127.0.0.1 but its requests say
    ``Host: evil.com:8000``; refusing them keeps browsers off a local server. Rules:

    * bound to loopback: the name must be localhost, 127.0.0.1, [::1], the bind host itself or an
      extra; any port, because the name is what an attacker controls and a dev proxy (Vite on
      :5173) forwards its own Host. A missing Host is refused: it cannot be checked, h11 already
      rejects it for HTTP/1.1, and every browser sends one.
    * bound to anything else (0.0.0.0 included): any Host, missing or not; the server is meant to be
      reached under names we cannot know, and the API key (``require_key_for_bind``) protects it.
    """

    def __init__(self, bind_host: str, port: int, extra_allowed: Iterable[str] = ()) -> None:
        self.port = port
        self.loopback = is_loopback_host(bind_host)
        names = set(LOOPBACK_NAMES)
        bind = split_host(bind_host)
        if bind is None and _ip(bind_host.strip()) is not None:
            bind = (bind_host.strip().lower(), None)  # a bare IPv6 bind address such as "::1"
        if bind is not None:
            names.add(bind[0])
        for extra in extra_allowed:
            parsed = split_host(extra)
            if parsed is None:
                raise ColibriError(f"allowed host {extra!r}: expected a host name or address")
            names.add(parsed[0])  # names only: ports are not checked (see above)
        self.names = frozenset(names)

    @property
    def expected(self) -> str:
        """How to address the server, for the error message a refused request gets."""
        return f"localhost:{self.port}"

    def allowed(self, host_header: str | None) -> bool:
        if not self.loopback:
            return True
        if host_header is None:
            return False
        parsed = split_host(host_header)
        return parsed is not None and parsed[0] in self.names


# --- CORS --------------------------------------------------------------------------------------------


def _normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()  # origins are scheme://host[:port]: case-insensitive


class CorsPolicy:
    """Which browser origins may call the API, and the Access-Control-* headers that say so.

    The defaults (``DEFAULT_CORS_ORIGINS``) plus ``origins`` (``--cors-origin``, exact origins or
    ``*`` for any). The allowed origin is echoed, never ``*``, with ``Vary: Origin`` for caches.
    """

    def __init__(self, origins: Iterable[str] = ()) -> None:
        extra = list(origins)
        self.any = "*" in (o.strip() for o in extra)
        allowed = set(DEFAULT_CORS_ORIGINS)
        for o in extra:
            if o.strip() == "*":
                continue
            n = _normalize_origin(o)
            if not _ORIGIN.fullmatch(n):
                raise ColibriError(
                    f"--cors-origin {o!r}: expected an exact origin such as https://ui.example "
                    "(scheme://host[:port], no path) or '*'"
                )
            allowed.add(n)
        self.origins = frozenset(allowed)

    def allows(self, origin: str | None) -> bool:
        if not origin:
            return False
        return self.any or _normalize_origin(origin) in self.origins

    def headers_for(self, origin: str | None, preflight: bool, request_headers: str | None) -> dict[str, str]:
        """Headers for a response to ``origin``; {} when it is not a CORS request or not allowed.

        ``request_headers`` is a preflight's Access-Control-Request-Headers. Well-formed names are
        allowed besides our own: the server acts on no other header, so letting a browser send one
        (the OpenAI SDK's x-stainless-*) grants nothing.
        """
        if origin is None or not self.allows(origin):
            return {}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if not preflight:
            headers["Access-Control-Expose-Headers"] = CORS_EXPOSE
            return headers
        allow = list(CORS_HEADERS)
        for name in (request_headers or "").split(",")[:MAX_REQUESTED_HEADERS]:
            name = name.strip().lower()
            if _TOKEN.fullmatch(name) and name not in allow:
                allow.append(name)
        headers["Access-Control-Allow-Methods"] = CORS_METHODS
        headers["Access-Control-Allow-Headers"] = ", ".join(allow)
        headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
        return headers


# --- Origin and Content-Type: what a foreign page can make a browser send -------------------------


def same_origin(origin: str, host_header: str | None) -> bool:
    """Whether ``origin`` is the server's own: an http(s) origin whose host:port is the Host header
    (which HostGuard has vetted). The web console at / posts with this origin."""
    if host_header is None:
        return False
    normalized = _normalize_origin(origin)
    if not _ORIGIN.fullmatch(normalized):
        return False
    scheme, _, authority = normalized.partition("://")
    mine, theirs = split_host(host_header), split_host(authority)
    if scheme not in DEFAULT_PORTS or mine is None or theirs is None:
        return False
    default = DEFAULT_PORTS[scheme]
    return (theirs[0], theirs[1] or default) == (mine[0], mine[1] or default)


def origin_allowed(origin: str | None, host_header: str | None, cors: CorsPolicy) -> bool:
    """No Origin (not a browser's cross-origin call), a CORS origin, or the server's own origin.

    Anything else is a page of another site: refused before any work, whatever the method, since
    a browser sends a "simple" request without asking first and only hides the answer from it.
    """
    return origin is None or cors.allows(origin) or same_origin(origin, host_header)


def is_json_content_type(value: str | None) -> bool:
    """``application/json``, any case, with or without parameters (``; charset=utf-8``)."""
    if not value:
        return False
    return value.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


# --- HTTP/1.1 framing --------------------------------------------------------------------------------


def ambiguous_framing_headers(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Both Content-Length and Transfer-Encoding (raw ASGI headers): RFC 9112 6.3 says a server
    may answer such a request but must close the connection after it, since a proxy in front may
    have framed the body the other way and the rest of it would be read as a smuggled request."""
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names

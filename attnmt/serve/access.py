"""Who may use the service: the Host and Origin checks and the security headers (an ASGI middleware), API keys and
request rates (checked per request by the routes).

* **Host** (``--allowed-hosts``): a request whose ``Host`` header names another host gets 400, so that a page of
  another site cannot reach a service on this machine through DNS rebinding.
* **Origin** (``--cors-origins``): a browser names the page's origin on a cross-site request; one from an origin
  not allowed gets 403 before anything is read or translated (even the "simple" requests a browser sends without
  asking first), and allowed origins get CORS answers (Starlette's ``CORSMiddleware``).
* **Headers**: every answer has ``X-Content-Type-Options: nosniff``, ``X-Frame-Options: DENY``, ``Referrer-Policy:
  no-referrer`` and a Content-Security-Policy that lets the page run only its own inline script and style (by
  their hashes), connect to this service only and be framed by nobody.
* **Keys and rates** (``--api-keys``, ``--req-limit``): :class:`Access`.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

from attnmt.errors import UserError


def default_hosts(bind: str) -> list[str] | None:
    """The Host names a service bound to ``bind`` answers to by default (None: any, for 0.0.0.0 and ::)."""
    if bind in ("0.0.0.0", "::", ""):
        return None
    names = {bind.lower().strip("[]")}
    try:
        if ipaddress.ip_address(bind.strip("[]")).is_loopback:
            names |= {"localhost", "127.0.0.1", "::1"}
    except ValueError:  # a name: itself
        if bind.lower() == "localhost":
            names |= {"127.0.0.1", "::1"}
    return sorted(names)


def parse_hosts(value: str, bind: str) -> list[str] | None:
    """``--allowed-hosts`` as names (None: any host)."""
    if not value.strip():
        return default_hosts(bind)
    names = [h.strip().lower().strip("[]") for h in value.split(",") if h.strip()]
    return None if "*" in names else names


def parse_origins(value: str) -> list[str]:
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise UserError(f"--cors-origins {o}: not an origin; give scheme://host[:port], e.g. https://app.example")
    return origins


def host_name(header: str) -> str:
    """The host of a Host header or an origin's authority, lower-cased, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def content_security_policy(page: str) -> str:
    """The CSP of every answer: the page's own inline script and style, by hash, and nothing else."""
    scripts = [_sha256(m) for m in re.findall(r"<script>(.*?)</script>", page, re.S)]
    styles = [_sha256(m) for m in re.findall(r"<style>(.*?)</style>", page, re.S)]
    return (f"default-src 'none'; script-src {' '.join(scripts) or chr(39) + 'none' + chr(39)}; "
            f"style-src {' '.join(styles) or chr(39) + 'none' + chr(39)}; connect-src 'self'; img-src 'self'; "
            f"base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class Guard:
    """The ASGI middleware of the Host and Origin checks and the security headers (see the module docstring)."""

    def __init__(self, app, hosts: list[str] | None, origins: list[str], csp: str, count=lambda status: None):
        self.app, self.hosts, self.origins, self.count = app, hosts, origins, count
        self.headers = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                        (b"referrer-policy", b"no-referrer"), (b"content-security-policy", csp.encode("ascii"))]

    async def refuse(self, send, status: int, message: str) -> None:
        self.count(status)
        body = json.dumps({"error": message}).encode("utf-8")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *self.headers]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin")}
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and host_name(host) not in self.hosts:
            return await self.refuse(send, 400, "the Host header names a host this service does not answer for; "
                                                "use the address it listens on (its operator can add names with "
                                                "--allowed-hosts)")
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/")
        if origin and "*" not in self.origins and origin not in self.origins \
                and origin.split("://", 1)[-1].lower() != host.lower():  # not the service's own page either
            return await self.refuse(send, 403, "a request from a web page of another origin; the service's "
                                                "operator allows origins with --cors-origins")

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        return await self.app(scope, receive, send_with_headers)


class Access:
    """API keys (``--api-keys``) and request rates (``--req-limit``: per key, or per client address without keys)."""

    CLIENTS = 10_000  # the request times remembered for at most this many keys or addresses (the oldest forgotten)

    def __init__(self, keys_file: str = "", req_limit: int = 0, window: float = 60.0):
        self.keys: set[bytes] | None = None
        if keys_file:
            path = Path(keys_file)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"--api-keys {keys_file}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                                f"give a text file of keys, one per line") from None
            keys = [line.split("#", 1)[0].strip() for line in text.splitlines()]
            self.keys = {hashlib.sha256(k.encode("utf-8")).digest() for k in keys if k}
            if not self.keys:
                raise UserError(f"--api-keys {keys_file}: no keys in it; write one key per line")
        self.req_limit, self.window = req_limit, window
        self._times: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, authorization: str | None, field) -> str | None:
        """The request's key (the Bearer header first, then LibreTranslate's ``api_key`` field); an error message
        (``(status, message)`` raised as ``PermissionError``) when keys are required and it is missing or
        unknown."""
        given = None
        if authorization and authorization[:7].lower() == "bearer ":
            given = authorization[7:].strip()
        elif isinstance(field, str) and field:
            given = field
        if self.keys is None:
            return given
        if not given:
            raise PermissionError(401, "an API key is required: send it as 'Authorization: Bearer KEY' or the "
                                       "'api_key' field")
        if hashlib.sha256(given.encode("utf-8", "replace")).digest() not in self.keys:
            raise PermissionError(403, "the API key is not valid")
        return given

    def allow(self, client: str, now: float | None = None) -> float:
        """0 when ``client`` (a key or an address) may make one more request now (it is counted); else the
        seconds until it may."""
        if not self.req_limit:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._times.pop(client, None) or deque()
            while times and times[0] <= now - self.window:
                times.popleft()
            self._times[client] = times
            while len(self._times) > self.CLIENTS:
                self._times.popitem(last=False)
            if len(times) >= self.req_limit:
                return max(0.001, times[0] + self.window - now)
            times.append(now)
            return 0.0


def is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False

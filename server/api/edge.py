"""The server's network edge: which Host and Origin a request may carry, and how long a client may take to send it.

- `EdgeGuard` (ASGI middleware, outermost): a `Host` not in `--allowed-hosts` gets 400 (a DNS-rebinding page
  reaches the server under its own name, so the name is what gives it away); with no API key, a request
  that changes state (anything but GET/HEAD/OPTIONS, and the live WebSocket's handshake) whose `Origin`
  is neither the server's own nor in `--allowed-origins` gets 403. Browsers send urlencoded, multipart and
  typeless bodies cross-origin without a CORS preflight, so without this any page the operator visits
  could create jobs; with a key, a page cannot send it (no CORS here), so the key is the defence.
- `read_deadline_protocol(seconds, header_seconds)`: uvicorn's h11 protocol with deadlines on reading one
  request: its headers within `--header-read-timeout`, and the whole of it (headers and body) within
  `--request-read-timeout`, from its first byte (from the connection's start for the first request).
  uvicorn 0.54 has none (its `timeout_keep_alive` only runs between requests), so a client that trickles
  a header line every few seconds would hold a connection for ever (slowloris). Past a deadline the
  client gets 408 if its headers were incomplete, and the connection is closed.
- `log_config(level)`: uvicorn's logging, with every query parameter whose name says it is a credential
  (`api_key`, `token`, `secret`, `password`, ...) written as `[redacted]` in the access log and the WebSocket
  lines: a key a client put in a URL never reaches the log.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import logging
import re
import secrets
from urllib.parse import urlsplit

log = logging.getLogger("longserve.server")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def parse_list(text: str | None) -> tuple[str, ...]:
    """A comma-separated flag value -> its items (lower case, stripped)."""
    return tuple(item.strip().lower() for item in (text or "").split(",") if item.strip())


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """--allowed-hosts when none is given: the bound address (and the loopback names when it is loopback);
    any host when bound to every interface (0.0.0.0, ::), where the server cannot know its own names."""
    if is_wildcard(bind_host):
        return ("*",)
    names = [bind_host.strip("[]").lower()]
    if is_loopback(bind_host):
        names += [n for n in LOOPBACK_NAMES if n not in names]
    return tuple(names)


def split_host_header(value: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1' (lower case)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


def exposure_warnings(bind_host: str, keyed: bool) -> list[str]:
    """What `longserve serve` logs at start and `/health` shows: an open server on a reachable address."""
    if keyed or is_loopback(bind_host):
        return []
    return [f"listening on {bind_host} with no API key: anyone who can reach this address can create, read and "
            f"delete videos; set LONGSERVE_API_KEY or --api-key-file, or bind 127.0.0.1 behind a proxy"]


def matching_key(given: str, keys: tuple[str, ...]) -> str | None:
    """The key among `keys` that `given` is, compared in constant time against every one; None if none."""
    found = None
    for key in keys:
        if secrets.compare_digest(given.encode(), key.encode()):
            found = key
    return found


def client_id(key: str) -> str:
    """Who a key is, for per-key limits and logs: a digest, never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class EdgeGuard:
    """ASGI middleware: the Host check for every request, the Origin check for state-changing ones when no
    key is set. Answers in the API's error envelope (a WebSocket handshake is refused, which uvicorn answers
    with 403)."""

    def __init__(self, app, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...], keyed):
        self.app = app
        self.allowed_hosts = tuple(h.strip("[]") for h in allowed_hosts)
        self.any_host = "*" in self.allowed_hosts
        self.allowed_origins = tuple(o.rstrip("/") for o in allowed_origins)
        self.any_origin = "*" in self.allowed_origins
        self.keyed = keyed                  # a callable: is an API key required right now

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        host = headers.get("host", "")
        if not self.host_allowed(host) and not is_probe(scope, host):
            return await self._refuse(scope, receive, send, 400, "invalid_host",
                                      f"Host {host!r} is not served here (--allowed-hosts)", "host")
        state_changing = scope["type"] == "websocket" or scope.get("method", "GET").upper() not in SAFE_METHODS
        origin = headers.get("origin")
        if state_changing and origin is not None and not self.keyed() and not self.origin_allowed(origin, host):
            return await self._refuse(scope, receive, send, 403, "cross_origin_refused",
                                      f"Origin {origin!r} may not change state on this server: it has no API key, "
                                      f"so cross-site requests are refused (--allowed-origins)", "origin")
        return await self.app(scope, receive, send)

    def host_allowed(self, host_header: str) -> bool:
        if self.any_host:
            return True
        host = split_host_header(host_header)
        return bool(host) and host in self.allowed_hosts

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        # the page the server itself served (same scheme-less host:port as the request's Host)
        return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == host_header.strip().lower()

    async def _refuse(self, scope, receive, send, status: int, code: str, message: str, param: str) -> None:
        log.warning("refused %s %s: %s", scope.get("method", "WEBSOCKET"), scope.get("path"), message)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})   # before accept: the handshake gets 403
            return
        from longserve.server.api.errors import ERROR_TYPES

        body = json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                                     "param": param, "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


#: what kubelet's probes and Prometheus' scrapes GET by the pod's address: read-only, no tenant's data
PROBE_PATHS = ("/health", "/health/live", "/health/ready", "/metrics")


def is_probe(scope, host_header: str) -> bool:
    """A probe or a scrape by address (kubelet's httpGet and Prometheus send the pod's IP as the Host, never the
    public name --allowed-hosts lists). A Host that is an IP literal cannot come from a DNS-rebinding page (the
    browser sends the attacker's name), so the Host rule lets these through."""
    import ipaddress

    if scope["type"] != "http" or scope.get("method") not in ("GET", "HEAD") or scope.get("path") not in PROBE_PATHS:
        return False
    try:
        ipaddress.ip_address(split_host_header(host_header))
    except ValueError:
        return False
    return True


# -- slow clients ------------------------------------------------------------------------------------------

REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                            b"content-length: 25\r\nconnection: close\r\n\r\nrequest not sent in time\n")


def read_deadline_protocol(timeout_s: float, header_timeout_s: float | None = None):
    """uvicorn's h11 protocol class with a deadline of `timeout_s` on reading each request (headers and body), and
    of `header_timeout_s` on its headers."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    header_s = min(timeout_s, header_timeout_s or timeout_s)

    class ReadDeadlineH11Protocol(H11Protocol):
        _deadline = None          # asyncio.TimerHandle while a request is being read
        _armed_cycle = None       # the request cycle that existed when the deadline was armed
        _started = 0.0            # when the request's reading began (the loop's clock)
        _in_headers = False       # the deadline running is the headers' (the app has not seen the request)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._in_headers = True
            self._started = self.loop.time()
            self._deadline = self.loop.call_at(self._started + header_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()             # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._armed_cycle and self._deadline is not None:
                self._disarm()          # its headers are in: the app has it
                if cycle.more_body:     # its body has what is left of the whole request's time
                    self._deadline = self.loop.call_at(self._started + timeout_s, self._read_timed_out)
                    self._armed_cycle, self._in_headers = cycle, False
            elif not self._in_headers and cycle is not None and cycle is self._armed_cycle and not cycle.more_body:
                self._disarm()          # the body is read in full

        def handle_websocket_upgrade(self, event) -> None:
            self._disarm()              # the socket belongs to the WebSocket protocol from here on
            super().handle_websocket_upgrade(event)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _read_timed_out(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return
            if self._in_headers:                       # the headers never came (the app never saw it)
                self.transport.write(REQUEST_TIMEOUT_RESPONSE)
            self.logger.info("closed a connection from %s: the request was not read within %g s",
                             self.client, timeout_s)
            self.transport.close()

    return ReadDeadlineH11Protocol


def uvicorn_options(config) -> dict:
    """The connection settings of `uvicorn.Config` from a `ServeConfig` (the CLI's and the tests' servers)."""
    return {"timeout_keep_alive": config.timeout_keep_alive, "limit_concurrency": config.limit_concurrency,
            "http": read_deadline_protocol(config.request_read_timeout_s, config.header_read_timeout_s)}


# -- credentials out of the logs -----------------------------------------------------------------------------

#: a query parameter whose name says it holds a credential, and its value
_SECRET_PARAM = re.compile(r"([?&][^=&#\s\"]*(?:key|token|secret|passw|auth|signature|credential)[^=&#\s\"]*=)"
                           r"[^&#\s\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the values of credential-looking query parameters replaced by `[redacted]`."""
    return _SECRET_PARAM.sub(r"\1[redacted]", text) if "=" in text else text


class RedactSecrets(logging.Filter):
    """On uvicorn's loggers: a record's message and arguments redacted (`redact`) before any handler sees them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def log_config(level: str = "info") -> dict:
    """uvicorn's logging configuration with `RedactSecrets` on its access and error loggers (`uvicorn.Config`'s
    `log_config`; its `log_level` still sets the level)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {**config.get("filters", {}), "redact_secrets": {"()": RedactSecrets}}
    for name in ("uvicorn.error", "uvicorn.access"):
        config["loggers"].setdefault(name, {})["filters"] = ["redact_secrets"]
        config["loggers"][name]["level"] = level.upper()
    return config

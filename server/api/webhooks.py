"""Webhooks: `video.completed` and `video.failed`, signed as OpenAI signs them, retried with backoff.

Where they go:
- **per server**: `--webhook-url URL` gets every video's events, signed with `$LONGSERVE_WEBHOOK_SECRET` (or the
  file `--webhook-secret-file`; a `whsec_`-prefixed base64 secret, or any text);
- **per key**: endpoints a key registers with OpenAI's `POST /v1/webhook_endpoints` (the openai client's
  `client.webhooks.create(name=..., url=..., event_types=["video.completed", ...])`), each with its own signing
  secret (returned once, at creation or rotation); they get the events of that key's videos only. Stored in the
  shared settings (`server/api/settings_store.py`), so every replica delivers to them.

The event is OpenAI's: `{"id": "evt_...", "object": "event", "created_at", "type": "video.completed", "data":
{"id": "video_..."}}`, POSTed as JSON with the Standard Webhooks headers OpenAI sends and the openai client's
`webhooks.unwrap` / `verify_signature` checks: `webhook-id` (the event's id, the same on every retry, so a receiver
can drop repeats), `webhook-timestamp` (epoch seconds of this attempt), `webhook-signature`: `v1,` + base64 of
HMAC-SHA256 over `"{webhook-id}.{webhook-timestamp}.{body}"` with the secret (base64-decoded when it starts with
`whsec_`). A delivery is retried while it fails (no answer, or not 2xx) after 1, 2, 4, 8, ... s, at most
`--webhook-attempts` tries (the replica that ran the job delivers; a delivery in flight is lost if it stops).

A key's endpoint URL is checked (a webhook is a request the server makes on a client's behalf): https to a public
address, unless its host is in `--webhook-allowed-hosts` (then http and any address: a receiver on the operator's
own network). At registration the URL is read as written (an address that is not public, a local name); a name is
resolved, and its addresses checked, at every delivery (a name may be re-pointed), never looked up at registration.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import time
import uuid
from urllib.parse import urlsplit

from longserve.server.api.errors import APIError

log = logging.getLogger("longserve.server")

EVENTS = ("video.completed", "video.failed")
KIND = "webhook"
#: the longest a delivery attempt may take (a receiver that hangs holds nothing else)
ATTEMPT_TIMEOUT_S = 10.0


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    return secret[:8] + "..." + secret[-4:]


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value (Standard Webhooks' v1, as OpenAI signs and its client verifies)."""
    key = base64.b64decode(secret[len("whsec_"):]) if secret.startswith("whsec_") else secret.encode()
    digest = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def server_secret(config) -> str | None:
    """The per-server endpoint's secret: `--webhook-secret-file`, else `$LONGSERVE_WEBHOOK_SECRET`."""
    if config.webhook_secret_file:
        try:
            with open(config.webhook_secret_file, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as e:
            raise ValueError(f"--webhook-secret-file {config.webhook_secret_file}: cannot read it ({e})") from None
        if not text:
            raise ValueError(f"--webhook-secret-file {config.webhook_secret_file}: it is empty")
        return text
    return os.environ.get("LONGSERVE_WEBHOOK_SECRET", "").strip() or None


class Webhooks:
    """The endpoints (the server's, and the keys' in `settings`) and their deliveries on the runner's loop."""

    def __init__(self, config, settings, runner, counter=None):
        self.settings, self.runner, self.counter = settings, runner, counter
        self.attempts = config.webhook_attempts
        self.allowed_hosts = {h.strip().lower() for h in (config.webhook_allowed_hosts or "").split(",") if h.strip()}
        self.server_url = config.webhook_url
        self.server_secret = server_secret(config) if config.webhook_url else None
        if config.webhook_url and self.server_secret is None:
            raise ValueError("--webhook-url needs a signing secret: $LONGSERVE_WEBHOOK_SECRET or --webhook-secret-file")

    # -- the endpoints ---------------------------------------------------------------------------------------

    def check_url(self, url) -> str:
        """A key's endpoint URL, or 400 naming `url` (the module docstring's rule; DNS is asked once here)."""
        if not isinstance(url, str) or len(url) > 2000:
            raise APIError(400, "url must be a URL string", param="url", code="invalid_value")
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https") or not host:
            raise APIError(400, f"url must be an http(s) URL; got {url[:200]!r}", param="url", code="invalid_value")
        if host in self.allowed_hosts or "*" in self.allowed_hosts:
            return url.strip()
        if parts.scheme != "https":
            raise APIError(400, f"url must be https (http only to a host in --webhook-allowed-hosts); got "
                                f"{url[:200]!r}", param="url", code="invalid_value")
        problem = self._literal_problem(host)      # a name is resolved when delivering, never here: no lookup
        if problem:                                 # on a client's behalf at registration
            raise APIError(400, f"url: {problem}", param="url", code="invalid_value")
        return url.strip()

    @staticmethod
    def _literal_problem(host: str) -> str | None:
        """Why `host` as written is not a public destination: an address that is not global, or a local name."""
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if host == "localhost" or host.endswith((".localhost", ".local", ".internal", ".lan")):
                return f"{host} is a local name (the operator may allow it with --webhook-allowed-hosts)"
            return None
        if not address.is_global:
            return (f"{address} is not a public address (the operator may allow it with --webhook-allowed-hosts)")
        return None

    def _private(self, host: str, port: int) -> str | None:
        """Why `host` may not be delivered to (it resolves to a non-public address), or None."""
        if host in self.allowed_hosts or "*" in self.allowed_hosts:
            return None
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        except OSError as e:
            return f"{host} does not resolve ({e.strerror or e})"
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if not address.is_global:
                return (f"{host} resolves to {address}, not a public address (the operator may allow it with "
                        f"--webhook-allowed-hosts)")
        return None

    def endpoints_for(self, owner: str | None, event_type: str) -> list[tuple[str, str, str]]:
        """(endpoint id, url, secret) of every endpoint `event_type` of a video of `owner` goes to."""
        out = []
        if self.server_url:
            out.append(("server", self.server_url, self.server_secret))
        for endpoint_id, _, data, _ in self.settings.list(KIND, owner):
            if event_type in data["event_types"]:
                out.append((endpoint_id, data["url"], data["secret"]))
        return out

    # -- deliveries ----------------------------------------------------------------------------------------------

    def video_event(self, video_id: str, owner: str | None, status: str) -> None:
        """A video ended (`status`: completed or failed): its event to every endpoint that wants it."""
        event_type = f"video.{status}"
        if event_type not in EVENTS:
            return
        try:
            targets = self.endpoints_for(owner, event_type)
        except Exception:  # noqa: BLE001 - the settings may be away for a moment; the job's end goes on
            log.exception("webhooks: the endpoints of %s could not be read", video_id)
            return
        if not targets:
            return
        event = {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "created_at": int(time.time()),
                 "type": event_type, "data": {"id": video_id}}
        body = json.dumps(event, separators=(",", ":")).encode()
        for endpoint_id, url, secret in targets:
            self.runner.spawn(self.deliver(endpoint_id, url, secret, event["id"], body,
                                           checked=endpoint_id == "server"))

    async def deliver(self, endpoint_id: str, url: str, secret: str, webhook_id: str, body: bytes,
                      checked: bool = False) -> int | None:
        """POST `body` to `url` until a 2xx or `attempts` tries (backoff 1, 2, 4, ... s); the last status (None: no
        answer)."""

        status, delay = None, 1.0
        for attempt in range(1, self.attempts + 1):
            problem = None
            if not checked:          # a key's endpoint: its address is checked again at every attempt
                parts = urlsplit(url)
                problem = await asyncio.get_running_loop().run_in_executor(
                    self.runner.io, self._private, (parts.hostname or "").lower(),
                    parts.port or (443 if parts.scheme == "https" else 80))
            if problem is None:
                status = await self._post(url, secret, webhook_id, body)
            if status is not None and 200 <= status < 300:
                self._count("delivered")
                return status
            log.warning("webhook %s to endpoint %s (%s): attempt %d of %d failed (%s)", webhook_id, endpoint_id,
                        url, attempt, self.attempts, problem or (f"HTTP {status}" if status else "no answer"))
            if attempt < self.attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 300.0)
        self._count("failed")
        return status

    async def test_delivery(self, url: str, secret: str, event_type: str) -> int | None:
        """`POST /v1/webhook_endpoints/{id}/test`: one sample event (data.id a made-up video), tried once."""
        parts = urlsplit(url)
        problem = await asyncio.get_running_loop().run_in_executor(
            None, self._private, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80))
        if problem is not None:
            raise APIError(400, f"url: {problem}", param="url", code="invalid_value")
        event = {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "created_at": int(time.time()),
                 "type": event_type, "data": {"id": "video_test"}}
        return await self._post(url, secret, event["id"], json.dumps(event, separators=(",", ":")).encode())

    async def _post(self, url: str, secret: str, webhook_id: str, body: bytes) -> int | None:
        import httpx

        timestamp = int(time.time())
        headers = {"content-type": "application/json", "user-agent": "longserve-webhooks",
                   "webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
                   "webhook-signature": sign(secret, webhook_id, timestamp, body)}
        try:
            async with httpx.AsyncClient(timeout=ATTEMPT_TIMEOUT_S, follow_redirects=False, trust_env=False) as c:
                return (await c.post(url, content=body, headers=headers)).status_code
        except httpx.HTTPError:
            return None

    def _count(self, outcome: str) -> None:
        if self.counter is not None:
            self.counter.labels(outcome=outcome).inc()

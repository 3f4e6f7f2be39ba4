"""`ServeConfig`: everything `longserve serve` configures, declared once (the engine's config, composed with the
server's own fields). Light on purpose: the CLI reads it to build its flags before anything heavy is imported."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from longserve.engine.config import MAX_STEPS, EngineConfig, build, option

#: what serving changes of the engine's defaults
SERVE_ENGINE_DEFAULTS = {"max_queue": 256}
#: how long a finished video's files are kept by default (its expires_at): a week
DEFAULT_RETENTION_S = 7 * 24 * 3600
#: creates are refused (507) below this much free disk by default: a few videos' worth and the database's growth
DEFAULT_MIN_FREE_BYTES = 256 << 20
#: how long SIGTERM lets running jobs finish by default; the stop timeout documented for Docker, compose and
#: Kubernetes (30 s) leaves the rest for failing what is left and stopping the workers
DEFAULT_DRAIN_S = 20.0


@dataclass(frozen=True)
class ServeConfig:
    """Everything `longserve serve` configures: the engine's config, plus the server's own options."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(**SERVE_ENGINE_DEFAULTS))

    # -- HTTP ---------------------------------------------------------------------------------------
    host: str = option("127.0.0.1", "address to listen on", group="http")
    port: int = option(8000, "port to listen on", group="http")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1 (default: $LONGSERVE_API_KEY; "
                                        "none = open); visible in the process list: prefer the variable or "
                                        "--api-key-file", group="http")
    max_body_bytes: int = option(4 << 20, "largest request body (413 beyond)", group="http")
    log_level: str = option("info", "server log level", group="http",
                            choices=["debug", "info", "warning", "error"])
    log_format: str = option("text", "the log's lines: text, or json (one JSON object a line, with each job "
                                     "transition's fields: id, owner, replica, durations)", group="http",
                             choices=["text", "json"])
    served_model_name: str | None = option(None, "the model id clients use (default: the model directory's name)",
                                           group="http")
    api_key_file: str | None = option(None, "read the API key(s) from this file, one per line (default: "
                                            "$LONGSERVE_API_KEY_FILE); keeps them out of the process list. Each key "
                                            "is a tenant (sees only its own videos); a line 'admin:KEY' is an "
                                            "admin key", group="http", metavar="PATH")
    admin_api_key: str | None = option(None, "an API key that sees and may delete every key's videos (default: "
                                              "$LONGSERVE_ADMIN_API_KEY); visible in the process list: prefer the "
                                              "variable or 'admin:KEY' in --api-key-file", group="http")
    allowed_hosts: str | None = option(None, "comma-separated Host names the server answers (400 otherwise; '*' any; "
                                             "default: the bound address, plus localhost, 127.0.0.1 and ::1 when "
                                             "it is loopback; any when bound to 0.0.0.0 or ::)", group="http")
    allowed_origins: str | None = option(None, "comma-separated origins (scheme://host[:port], '*' any) that may "
                                               "POST/DELETE or open a live socket when no API key is set, besides "
                                               "the server's own (403 otherwise)", group="http")
    timeout_keep_alive: int = option(5, "close an idle kept-alive connection after this many seconds", group="http")
    limit_concurrency: int | None = option(1024, "most open connections and requests at once (503 beyond)",
                                           group="http")
    header_read_timeout_s: float = option(5.0, "a client must send a request's headers within this many seconds of "
                                               "its first byte (of connecting, for the first request), or it gets "
                                               "408 and is disconnected: slow-header sockets hold no slot for "
                                               "long", group="http", flag="--header-read-timeout",
                                          metavar="SECONDS")
    max_streams_per_key: int | None = option(16, "most streams one API key (or, without keys, one address) holds "
                                                 "open at once: event streams, streamed downloads and live "
                                                 "sessions (429 too_many_streams beyond); none = no cap",
                                             group="http")
    rate_per_key: float | None = option(20.0, "requests a second one API key (or, without keys, one address) may "
                                              "make on /v1, on average (a token bucket; 429 rate_limited with "
                                              "Retry-After beyond); none = no limit", group="http",
                                        metavar="PER_SECOND")
    rate_burst: int = option(40, "requests one key may make at once before --rate-per-key applies (the bucket's "
                                 "size)", group="http")
    docs: bool = option(False, "serve the API's reference at /docs (a plain page made here, no script; with keys it "
                               "needs one, like the API); /openapi.json follows the same key rules", group="http")
    webrtc_networks: str | None = option(None, "comma-separated networks (10.0.0.0/8,fd00::/8) whose addresses a "
                                               "WebRTC offer's candidates may have, besides the client's own, and "
                                               "where the server's own addresses are offered in answers, besides "
                                               "the one the client reached (docs/serving.md, security)",
                                         group="http", metavar="CIDRS")
    request_read_timeout_s: float = option(30.0, "a client must send a whole request (headers and body) within "
                                                 "this many seconds, or it gets 408 and is disconnected",
                                           group="http", flag="--request-read-timeout", metavar="SECONDS")

    # -- jobs ---------------------------------------------------------------------------------------
    data_dir: str = option("longserve-data", "SQLite job store and video files (kept across restarts)",
                           group="jobs")
    retention_s: float | None = option(DEFAULT_RETENTION_S, "delete a finished video's files this many seconds "
                                                            "after it finished (its expires_at; the record stays, "
                                                            "marked expired); none = keep them",
                                       group="jobs", flag="--retention", metavar="SECONDS")
    max_storage_bytes: int | None = option(None, "quota on each API key's stored bytes (its videos, a reused copy "
                                                 "counted once, and its queued jobs' uploads): over it, that key's "
                                                 "own videos used longest ago are deleted first (marked expired; "
                                                 "running jobs and its newest video are never touched; another "
                                                 "key's never); without keys, the server's; none = no quota",
                                           group="jobs", metavar="BYTES")
    max_total_storage_bytes: int | None = option(None, "cap on everyone's stored bytes together: over it, the key "
                                                       "keeping the most loses its oldest videos first; none = no "
                                                       "cap", group="jobs", metavar="BYTES")
    min_free_bytes: int = option(DEFAULT_MIN_FREE_BYTES, "refuse new videos (HTTP 507, Retry-After) while the data "
                                                         "dir's file system has less free space than this; "
                                                         "/health says degraded", group="jobs", metavar="BYTES")
    reuse_completed: str = option("seeded", "an identical request (same model, prompt, parameters, input image "
                                            "and an explicit seed) to a completed video gets a new video with the "
                                            "stored content and no generation: seeded | off",
                                  group="jobs", choices=["seeded", "off"])
    drain_seconds: float = option(DEFAULT_DRAIN_S, "on SIGTERM: stop admitting, let running videos finish for up "
                                                   "to this long, then fail the rest (server_shutdown) and exit",
                                  group="jobs", metavar="SECONDS")

    store: str | None = option(None, "the job store: none = a SQLite file under --data-dir (one server); "
                                     "postgresql://user@host:5432/db (a schema: libpq's options, search_path) = "
                                     "one PostgreSQL that several replicas share (docs/serving.md); default "
                                     "$LONGSERVE_STORE (keeps a password out of the process list)", group="jobs",
                               metavar="URL")
    store_wait_s: float = option(10.0, "with a PostgreSQL store: at start, how long to keep trying a database that "
                                       "does not answer (backoff up to 8 s between tries) before stopping with one "
                                       "line naming --store", group="jobs", flag="--store-wait", metavar="SECONDS")
    media_store: str | None = option(None, "where the videos' files go: none = <data-dir>/videos; file:///path = a "
                                           "directory every replica mounts; s3://bucket/prefix = S3-compatible "
                                           "object storage (with --store postgresql://; AWS_ENDPOINT_URL_S3 and "
                                           "the AWS credentials as boto3 reads them)", group="jobs", metavar="URL")
    store_timeout_s: float = option(3.0, "with a PostgreSQL store: how long a request waits for the database "
                                         "(a pooled connection, or a new one) before it is answered 503 "
                                         "storage_unavailable with Retry-After; /health says degraded while it "
                                         "does not answer", group="jobs", flag="--store-timeout",
                                    metavar="SECONDS")
    lease_seconds: float = option(10.0, "with a PostgreSQL store: a replica renews its running jobs' leases every "
                                        "third of this; a job whose lease lapses (its replica died) is queued again",
                                  group="jobs", metavar="SECONDS")
    max_attempts: int = option(3, "with a PostgreSQL store: a job whose lease lapsed this many times fails "
                                  "(replica_lost) instead of being queued again", group="jobs")
    replica_id: str | None = option(None, "this replica's name in the shared store (default: host name and process "
                                          "id)", group="jobs")

    lora_dir: str | None = option(None, "the directory LoRA adapters may be loaded from while serving (POST /v1/loras, "
                                        "admin key; every replica loads it); none = only --lora at start",
                                  group="jobs", metavar="DIR")
    webhook_url: str | None = option(None, "POST video.completed and video.failed events of every video here, signed "
                                           "as OpenAI signs them (the secret: $LONGSERVE_WEBHOOK_SECRET or "
                                           "--webhook-secret-file); keys add their own endpoints with POST "
                                           "/v1/webhook_endpoints", group="jobs", metavar="URL")
    webhook_secret_file: str | None = option(None, "the --webhook-url endpoint's signing secret, read from this file "
                                                   "(whsec_<base64>, or any text)", group="jobs", metavar="PATH")
    webhook_allowed_hosts: str | None = option(None, "comma-separated hosts a key's webhook endpoint may name over "
                                                     "http or at a private address (default: https to public "
                                                     "addresses only; '*' any)", group="jobs")
    webhook_attempts: int = option(6, "tries of a webhook delivery that fails (no answer or not 2xx), 1, 2, 4, ... s "
                                      "apart", group="jobs")

    # -- request limits (they default from the model; the request defaults are the engine's) ---------------
    max_frames: int | None = option(None, "longest video in frames (default: 4 x the model's default frame count; "
                                          "for a long-video model, --max-seconds at its fps)", group="limits")
    max_seconds: float = option(60.0, "longest video of a long-video (diffusion forcing) model, in seconds at its "
                                      "fps", group="limits")
    max_size: int | None = option(None, "largest width or height in pixels (default: 2 x the model's native size)",
                                  group="limits")
    max_steps: int = option(200, "most denoising steps a request may ask for", group="limits")
    max_fps: int = option(60, "highest fps a request may ask for", group="limits")
    max_prompt_chars: int = option(4000, "longest prompt (and negative prompt) in characters", group="limits")
    max_image_pixels: int = option(4096 * 4096, "largest input_reference image (width x height), checked from its "
                                                "header before it is decoded (400 beyond)", group="limits",
                                   metavar="PIXELS")
    max_queued_work: float | None = option(256.0, "most queued plus running work, in default requests (frames x "
                                                  "pixels x steps relative to the model's defaults): a create past "
                                                  "it gets 429 (one request alone is always admitted); none = count "
                                                  "only --max-queue", group="limits", metavar="REQUESTS")
    max_work_per_key: float | None = option(None, "most queued plus running work of one API key, in default "
                                                  "requests (429 beyond); none = no per-key limit",
                                            group="limits", metavar="REQUESTS")
    max_live_seconds: float = option(600.0, "a live session (WebSocket /v1/videos/live, causal models) ends after "
                                            "this many seconds of video", group="limits")
    live_buffer_chunks: int = option(8, "chunks a live session's client may fall behind before new ones are "
                                        "dropped for it (the others never wait)", group="limits")

    # -- scoring (POST /v1/score) ----------------------------------------------------------------------
    score_model: str | None = option("tiny-lm", "causal LM for /v1/score (tiny-lm or a local directory); 'none' "
                                                "disables scoring", group="scoring")
    score_workers: int = option(1, "workers of the scoring pool", group="scoring")
    score_strategy: str = option("lss", "lss | ring", group="scoring", choices=["lss", "ring"])
    warm_up: bool = option(True, "run one video at the model's default shape before /health says ok, so that the "
                                 "first client's video costs what later ones do", group="jobs")
    warm_up_shape: str | None = option(None, "the warm-up video's shape, WIDTHxHEIGHT[xFRAMES] (e.g. 832x480x81: the "
                                             "shape the deployment will serve); default: the model's default",
                                       group="jobs", metavar="WxH[xF]")
    score_preload: bool = option(False, "start the scoring pool now, not on first use", group="scoring")
    score_concurrency: int = option(1, "/v1/score calls run at once (on threads of their own, not the API's)",
                                    group="scoring")
    score_max_queue: int = option(8, "/v1/score calls that may wait for a free slot (429 beyond)", group="scoring")
    score_max_bytes: int | None = option(None, "longest /v1/score text in UTF-8 bytes, checked before tokenizing "
                                               "(413 beyond; default: the model's positions x its longest token, "
                                               "the most a text that fits can have)", group="scoring")

    def __post_init__(self):
        self._check_edge_and_admission()
        self._check_replicas()
        for name in ("max_steps", "max_fps", "max_prompt_chars", "max_body_bytes", "score_workers",
                     "max_image_pixels", "webhook_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.engine.default_steps is not None and self.engine.default_steps > self.max_steps:
            raise ValueError(f"default_steps ({self.engine.default_steps}) exceeds max_steps ({self.max_steps})")
        if self.max_steps > MAX_STEPS:
            raise ValueError(f"max_steps must be <= {MAX_STEPS} (the engine's limit), got {self.max_steps}")
        if self.reuse_completed not in ("seeded", "off"):
            raise ValueError(f"reuse_completed must be 'seeded' or 'off', got {self.reuse_completed!r}")
        if self.retention_s is not None and (isinstance(self.retention_s, bool)
                                             or not isinstance(self.retention_s, (int, float))
                                             or not self.retention_s > 0 or not math.isfinite(self.retention_s)):
            raise ValueError(f"retention_s must be a positive number of seconds or None, got {self.retention_s!r}")
        for name in ("max_storage_bytes", "max_total_storage_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.min_free_bytes, bool) or not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be a non-negative integer, got {self.min_free_bytes!r}")
        if (isinstance(self.drain_seconds, bool) or not isinstance(self.drain_seconds, (int, float))
                or not math.isfinite(self.drain_seconds) or self.drain_seconds < 0):
            raise ValueError(f"drain_seconds must be a non-negative number of seconds, got {self.drain_seconds!r}")

    def _check_replicas(self) -> None:
        parse_shape(self.warm_up_shape)            # ValueError naming --warm-up-shape
        from longserve.server.api.media_store import check_media_store, is_object_store

        check_media_store(self.media_store)
        if self.store is not None and (not isinstance(self.store, str)
                                       or self.store.split(":", 1)[0] not in ("postgresql", "postgres")):
            raise ValueError(f"store must be a postgresql:// URL or None (the SQLite file under data_dir), got "
                             f"{self.store!r}")
        if self.store is None and is_object_store(self.media_store):
            raise ValueError(f"media_store: an object store ({self.media_store!r}) is for replicas: it needs store "
                             f"postgresql://... (one server keeps its videos under data_dir, or a file:// directory)")
        if isinstance(self.lease_seconds, bool) or not isinstance(self.lease_seconds, (int, float)) \
                or not math.isfinite(self.lease_seconds) or not self.lease_seconds >= 1:
            raise ValueError(f"lease_seconds must be a number of seconds >= 1, got {self.lease_seconds!r}")
        if isinstance(self.store_wait_s, bool) or not isinstance(self.store_wait_s, (int, float)) \
                or not math.isfinite(self.store_wait_s) or self.store_wait_s < 0:
            raise ValueError(f"store_wait_s must be a non-negative number of seconds, got {self.store_wait_s!r}")
        if isinstance(self.store_timeout_s, bool) or not isinstance(self.store_timeout_s, (int, float)) \
                or not 0.5 <= self.store_timeout_s <= 60:
            raise ValueError(f"store_timeout_s must be a number of seconds in [0.5, 60], got {self.store_timeout_s!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be a positive integer, got {self.max_attempts!r}")
        if self.replica_id is not None and (not isinstance(self.replica_id, str)
                                            or not re.fullmatch(r"[A-Za-z0-9_.:\-]{1,100}", self.replica_id)):
            raise ValueError(f"replica_id must be 1-100 letters, digits or _.:-, got {self.replica_id!r}")

    def _check_edge_and_admission(self) -> None:
        from longserve.server.api.webrtc import parse_networks

        parse_networks(self.webrtc_networks)
        for name in ("timeout_keep_alive", "score_concurrency", "rate_burst"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("limit_concurrency", "score_max_bytes", "max_streams_per_key"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.score_max_queue, bool) or not isinstance(self.score_max_queue, int) \
                or self.score_max_queue < 0:
            raise ValueError(f"score_max_queue must be a non-negative integer, got {self.score_max_queue!r}")
        for name in ("request_read_timeout_s", "header_read_timeout_s", "max_queued_work", "max_work_per_key",
                     "rate_per_key"):
            value = getattr(self, name)
            if value is None and name not in ("request_read_timeout_s", "header_read_timeout_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a comma-separated list of names, got {value!r}")

    @classmethod
    def from_options(cls, **options) -> "ServeConfig":
        """A config from one flat set of options: the engine's fields go to `engine` (with serving's defaults)."""
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = EngineConfig.from_options(**{**SERVE_ENGINE_DEFAULTS,
                                              **{k: v for k, v in options.items() if k in engine_names}})
        return build(cls, {"engine": engine, **{k: v for k, v in options.items() if k not in engine_names}})

    @property
    def model(self) -> str:
        return self.engine.model


def safe_url(url: str) -> str:
    """A store URL as it may be shown (logs, errors): its password replaced."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def parse_shape(text: str | None) -> tuple[int, int, int | None] | None:
    """`--warm-up-shape`: "WxH" or "WxHxFRAMES" -> (width, height, frames or None); None or "default": the model's.
    ValueError naming the flag otherwise."""
    if text is None or str(text).strip().lower() in ("", "default"):
        return None
    parts = str(text).lower().replace(" ", "").split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or any(v < 1 for v in values):
        raise ValueError(f"--warm-up-shape must be WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES (e.g. 832x480x81), or "
                         f"'default'; got {text!r}")
    return values[0], values[1], values[2] if len(values) == 3 else None

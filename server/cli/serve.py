"""`longserve serve --model tiny-latte --workers 2 --host 127.0.0.1 --port 8000`: the OpenAI-compatible server.

Every flag is a field of `engine.config.EngineConfig` (the model, its workers, the
scheduler) or of `server.api.config.ServeConfig` (HTTP, jobs, limits, scoring), with the
field's help text. See docs/serving.md for the API, the scheduler and the deployment.

SIGTERM (and a first Ctrl-C) drains: no new videos (503), running ones get --drain-seconds to
finish, the rest fail with `server_shutdown`, open streams end with the error envelope; then
uvicorn's own graceful shutdown (SHUTDOWN_GRACE_S) and the workers stop. A second signal cuts
the drain short.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("longserve.server")

#: uvicorn's graceful shutdown after the drain: every stream has ended by then, only plain requests remain
SHUTDOWN_GRACE_S = 2

GROUP_TITLES = {"model": "model and workers", "defaults": "request defaults (what a request that leaves a field "
                                                            "out gets; default: the model's)",
                "scheduling": "scheduling", "http": "HTTP", "jobs": "jobs",
                "limits": "request limits (default from the model)", "scoring": "scoring (POST /v1/score)"}
#: the request defaults' older spellings on this command
DEFAULT_ALIASES = {"default_guidance_scale": ("--guidance-scale",), "default_fps": ("--fps",)}


def add_arguments(p) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args
    from longserve.server.api.config import SERVE_ENGINE_DEFAULTS, ServeConfig

    add_cli_args(p, EngineConfig, defaults=SERVE_ENGINE_DEFAULTS, titles=GROUP_TITLES, aliases=DEFAULT_ALIASES)
    add_cli_args(p, ServeConfig, defaults={"api_key_file": os.environ.get("LONGSERVE_API_KEY_FILE"),
                                           "store": os.environ.get("LONGSERVE_STORE") or None},
                 titles=GROUP_TITLES)
    p.add_argument("--config", metavar="PATH", default=None,
                   help="a YAML (or JSON) file of settings: its keys are the config fields the flags set (model, "
                        "workers, max_batch or max-batch, ...); a flag given on the command line wins")


def check(args) -> None:
    """What is refused before the fork server and the heavy imports start: a `--store` that does not answer (tried
    again with backoff for --store-wait, quietly: a database starting beside the replicas; then one line naming the
    flag, instead of after the model's imports)."""
    if not getattr(args, "store", None) or args.store.split(":", 1)[0] not in ("postgresql", "postgres"):
        return
    from longserve.server.api.config import safe_url
    from longserve.server.api.store_wait import wait_for_database

    try:
        wait_for_database(args.store, args.store_wait_s)
    except RuntimeError as e:                   # errors.StoreUnavailable
        raise ValueError(f"--store {safe_url(args.store)}: {e}") from None


def config_file_defaults(path: str, parser) -> dict:
    """`--config PATH` -> {field: value} for `parser.set_defaults`: a mapping whose keys are the command's own
    settings (ValueError naming the file and the key otherwise; an API key belongs in --api-key-file)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)          # JSON is YAML too
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config: {path} is not YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of settings, not {type(data).__name__}")
    known = vars(parser.parse_known_args([])[0])
    out = {}
    for key, value in data.items():
        field = str(key).replace("-", "_")
        if field not in known or field == "config":
            raise ValueError(f"--config: {path}: unknown setting {key!r} (the keys are serve's flags' fields, "
                             f"e.g. model, workers, max_batch)")
        out[field] = value
    return out


def api_keys(args) -> tuple[str, ...]:
    """The keys the server requires (every one, admin keys included): `key_sets(args)[0]`."""
    return key_sets(args)[0]


def key_sets(args) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the keys the server requires, the admin keys among them). The keys come from the first of: --api-key
    (logged as visible to every local user), --api-key-file (one key per line; blank lines and # comments
    skipped; `admin:KEY` is an admin key), $LONGSERVE_API_KEY; an admin key also from --admin-api-key or
    $LONGSERVE_ADMIN_API_KEY. None at all: open (server/api/tenants.py)."""
    from longserve.server.api.tenants import split_admin_keys

    keys, admins = (), ()
    if args.api_key:
        log.warning("--api-key given on the command line: every local user can read it in the process list "
                    "(ps, /proc/<pid>/cmdline); use $LONGSERVE_API_KEY or --api-key-file instead")
        keys = (args.api_key,)
    elif args.api_key_file:
        try:
            text = Path(args.api_key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        keys, admins = split_admin_keys(tuple(line.strip() for line in text.splitlines()
                                              if line.strip() and not line.lstrip().startswith("#")))
        if not keys:
            raise SystemExit(f"--api-key-file {args.api_key_file}: no key in it (one key per line)")
    else:
        env = os.environ.get("LONGSERVE_API_KEY", "").strip()
        keys = (env,) if env else ()
    admin = getattr(args, "admin_api_key", None)
    if admin:
        log.warning("--admin-api-key given on the command line: every local user can read it in the process list; "
                    "use $LONGSERVE_ADMIN_API_KEY or 'admin:KEY' in --api-key-file instead")
    admin = admin or os.environ.get("LONGSERVE_ADMIN_API_KEY", "").strip()
    if admin:
        admins += (admin,)
    return tuple(dict.fromkeys(keys + admins)), tuple(dict.fromkeys(admins))


def config_from_args(args):
    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.server.api.config import ServeConfig

    return from_cli_args(ServeConfig, args, engine=from_cli_args(EngineConfig, args))


def build(args, start: bool = True):
    """(video service, score service or None, app) from parsed arguments; with `start`, the video workers are
    started here (else the caller starts them: `run` does, on a thread, while the HTTP server already answers)."""
    from longserve.server.api.app import create_app
    from longserve.server.api.service import VideoService

    config = config_from_args(args)
    keys, admins = key_sets(args)             # a bad key file stops the start before the workers load
    videos = VideoService(config)
    if start:
        videos.start()
    score = score_service(config)
    if start and score is not None and config.score_preload:
        score.load()
    app = create_app(videos, score, api_key=keys, admin_api_key=admins, max_body_bytes=config.max_body_bytes)
    for warning in app.state.edge_warnings:
        log.warning("%s", warning)
    return videos, score, app


def score_service(config):
    from longserve.server.api.score_service import ScoreService

    if not config.score_model or config.score_model.lower() == "none":
        return None
    return ScoreService(config.score_model, workers=config.score_workers, strategy=config.score_strategy,
                        device=config.engine.device, concurrency=config.score_concurrency,
                        max_queue=config.score_max_queue, max_bytes=config.score_max_bytes)


def run(args) -> int:
    """Listen first, load second: `/health/live` answers from the moment the port is open and `/health/ready` tells
    the start's stages (store, workers, warm-up) while a thread loads; a start that fails stops the server with
    one line (exit 2 for a bad argument or an unreachable --store, 1 otherwise)."""
    import uvicorn

    from longserve.server.api.logs import configure_logging

    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    videos, score, app = build(args, start=False)
    compiling = "; compiling its transformer blocks with a warm-up step" if args.compile != "none" else ""
    print(f"listening on http://{args.host}:{args.port} (/health/live answers now, /health/ready once the model is "
          f"loaded and warm); loading {args.model} on {args.workers} worker(s), parallel={args.parallel}"
          f"{compiling} ...", file=sys.stderr, flush=True)
    from longserve.server.api.edge import uvicorn_options

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, log_config=None,    # logs.configure_logging
                            **uvicorn_options(videos.config))
    server = _draining_server_class()(config, videos, videos.config.drain_seconds)
    outcome: dict = {}
    loader = threading.Thread(target=_start, args=(args, videos, score, server, outcome), name="longserve-start",
                              daemon=True)
    # a SIGTERM before uvicorn takes the signals over: an orderly exit (the start stops, the store is closed)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    loader.start()
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        videos.close()                # a start still loading stops after its stage
        loader.join(timeout=60)
        if score is not None:
            score.close()
    error = outcome.get("error")
    if error is not None:
        print(f"longserve serve: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, (ValueError, FileNotFoundError)) else 1
    return 0


def _start(args, videos, score, server, outcome: dict) -> None:
    """The start, on its own thread: the video service's stages, the scoring pool if preloaded; then the lines that
    say what is served. A failure is kept in `outcome` and stops the HTTP server (no traceback for a bad argument
    or an unreachable store; the log has the rest)."""
    try:
        videos.start()
        if score is not None and videos.config.score_preload:
            score.load()
    except BaseException as e:  # noqa: BLE001 - told once, by run(), after the HTTP server stopped
        if not videos._closing:
            if not isinstance(e, (ValueError, FileNotFoundError)):
                log.error("the start failed", exc_info=e)
            outcome["error"] = e
        server.should_exit = True
        return
    from longserve.engine.startup import freeze_heap
    from longserve.server.api.startup import describe_store
    from longserve.server.cli.generate import speed_levers

    freeze_heap()             # what the start loaded stays for the process's life: full collections skip it
    if videos.engine is not None and speed_levers(videos.engine.info):
        print(f"loaded{speed_levers(videos.engine.info).lstrip(',')}", file=sys.stderr)
    if videos.warm_up_s is not None:
        print(f"warmed up: one video in {videos.warm_up_s:.1f} s (--warm-up-shape sets its shape; --no-warm-up "
              f"skips it)", file=sys.stderr)
    lim = videos.limits
    print(f"serving {videos.model_name} on http://{args.host}:{args.port} (jobs in {describe_store(videos.config)}; "
          f"max batch {args.max_batch}; frames <= {lim.max_frames}, sides <= {lim.max_size} px, "
          f"steps <= {lim.max_steps})", file=sys.stderr, flush=True)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def _draining_server_class():
    """`DrainingServer` (a subclass of uvicorn's server, so built where uvicorn is imported: not for --help)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first SIGTERM or SIGINT drains the video jobs (`VideoService.drain`, on a
        thread of its own) before uvicorn's graceful shutdown starts; a second one cuts the drain short. The
        signal is not raised again afterwards: the process exits 0 once everything is closed."""

        def __init__(self, config, videos, drain_s: float):
            super().__init__(config)
            self.videos, self.drain_s = videos, drain_s
            self._drain: threading.Thread | None = None
            self._cut_short = threading.Event()

        def handle_exit(self, sig, frame) -> None:
            if not self.videos.started:           # still loading: nothing to drain; the start stops at its stage
                log.warning("signal %d while starting: stopping", sig)
                self.should_exit = True
                return
            if self._drain is None:
                log.warning("signal %d: draining (running videos get %g s), then stopping", sig, self.drain_s)
                self._drain = threading.Thread(target=self._drain_then_exit, name="longserve-drain", daemon=True)
                self._drain.start()
            else:
                log.warning("signal %d again: failing what still runs now", sig)
                self._cut_short.set()

        def _drain_then_exit(self) -> None:
            try:
                self.videos.drain(self.drain_s, self._cut_short)
            except Exception:
                log.exception("draining failed")
            finally:
                self.should_exit = True

    return DrainingServer


"""The server's log: one configuration for every logger (ours, uvicorn's access lines, the engine's), as text or as
one JSON object a line (`--log-format json`, for a log collector), and one structured line per job transition.

    2026-11-30 12:00:01 INFO longserve.jobs: job video_ab12 created owner=key-1f2e model=tiny-latte ...
    {"ts": "...", "level": "INFO", "logger": "longserve.jobs", "message": "job video_ab12 created ...",
     "event": "created", "job": "video_ab12", "owner": "key-1f2e", "replica": null, ...}

Transitions (`job_event`): created (accepted), claimed (a replica took it from the shared store), started (admitted:
its denoising begins; `queue_wait_s`), progress (sampled: at most every `PROGRESS_EVERY_S` seconds and at each
quarter of its steps), finished (`e2e_s`, the stage times), failed (`code`), cancelled. Each carries the job's id,
its owner (the key's id, never the key), the replica and the durations known so far.
"""

from __future__ import annotations

import json
import logging
import sys
import time

jobs_log = logging.getLogger("longserve.jobs")

#: a running job's progress line at most this often (and at each quarter of its steps)
PROGRESS_EVERY_S = 10.0
#: what a LogRecord carries besides its message: not repeated as fields of a JSON line
_PLAIN = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the fields a `job_event` gave, a traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _PLAIN and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """The root logger for a `longserve serve` process: every logger (uvicorn's too, whose own configuration the
    server does not install: its access and error lines keep `edge.RedactSecrets`) writes through it, as text or
    JSON lines, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    from longserve.server.api.edge import RedactSecrets

    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        if name != "uvicorn" and not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())     # credentials in a URL's query never reach the log (edge.py)


def job_event(event: str, job_id: str, owner: str | None, replica: str | None = None, **fields) -> None:
    """One line for a job's transition, its fields in the text and as fields of a JSON line."""
    fields = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    jobs_log.info("job %s %s owner=%s replica=%s%s", job_id, event, owner or "-", replica or "-",
                  f" {text}" if text else "", extra={"event": event, "job": job_id, "owner": owner,
                                                       "replica": replica, **fields})


class ProgressSampler:
    """Whether a running job's step is worth a progress line: at most every PROGRESS_EVERY_S, and at each quarter."""

    def __init__(self):
        self.last_t = time.monotonic()
        self.last_quarter = 0

    def due(self, step: int, num_steps: int) -> bool:
        quarter = 4 * step // max(1, num_steps)
        now = time.monotonic()
        if quarter > self.last_quarter or now - self.last_t >= PROGRESS_EVERY_S:
            self.last_quarter, self.last_t = max(quarter, self.last_quarter), now
            return step < num_steps or quarter >= 4
        return False

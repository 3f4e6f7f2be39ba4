"""`ScoreService`: `POST /v1/score` on its own worker pool (`pipelines.TextScoringPipeline`).

The scoring pool is separate from the video pool (different model, different lockstep
jobs) and starts on the first request unless `--score-preload` asks for it at startup.
Calls are serialized (one pool, lockstep workers) and run off the event loop.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

from server.api.errors import APIError
from server.api.protocol import ScoreResponse


class ScoreService:
    def __init__(self, model: str = "tiny-lm", workers: int = 1, strategy: str = "lss", device: str | None = None,
                 dtype: str | None = None):
        self.model = model
        self.model_name = Path(str(model).rstrip("/")).name or str(model)
        self.model_names = {self.model_name, str(model)}
        self.workers, self.strategy, self.device, self.dtype = workers, strategy, device, dtype
        self._scorer = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._scorer is not None

    def load(self):
        from pipelines.scoring import TextScoringPipeline

        with self._lock:
            if self._scorer is None:
                self._scorer = TextScoringPipeline.from_pretrained(self.model, workers=self.workers,
                                                                   strategy=self.strategy, device=self.device,
                                                                   dtype=self.dtype)
        return self._scorer

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"model {model!r} is not a scoring model served here; this server scores with "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def score(self, text: str) -> ScoreResponse:
        """Blocking: run it in a thread."""
        from engine.pool import WorkerError
        from pipelines.scoring import ScoringInputError

        if not text:
            raise APIError(400, "text must not be empty", param="text", code="invalid_value")
        scorer = self.load()
        try:
            with self._lock:
                r = scorer.score(text)
        except ScoringInputError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_value") from None
        except WorkerError as e:
            if e.kind == "input":
                raise APIError(400, str(e), param=e.field or "text", code="invalid_value") from None
            where = f"worker {e.rank}" if e.rank is not None else "the worker pool"
            status, code = {"out_of_memory": (503, "out_of_memory"), "internal": (500, "internal_error")}.get(
                e.kind, (503, "worker_failed"))
            raise APIError(status, f"scoring failed on {where} ({e.kind}); the pool was restarted: "
                                   f"{str(e).splitlines()[0]}", code=code) from None
        finite = lambda v: v if v is not None and math.isfinite(v) else None  # noqa: E731
        return ScoreResponse(model=self.model_name, num_tokens=r.num_tokens, num_bytes=r.num_bytes,
                             total_nll=r.total_nll, mean_nll=r.mean_nll, perplexity=finite(r.perplexity),
                             bits_per_byte=finite(r.bits_per_byte), seconds=r.seconds)

    def close(self) -> None:
        with self._lock:
            if self._scorer is not None:
                self._scorer.close()
                self._scorer = None

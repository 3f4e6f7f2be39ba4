"""`ScoreService`: `POST /v1/score` on its own worker pool (`pipelines.TextScoringPipeline`).

The scoring pool is separate from the video pool (different model, different lockstep
jobs) and starts on the first request unless `--score-preload` asks for it at startup.
Calls are serialized (one pool, lockstep workers) and run off the event loop, on threads of
their own (`--score-concurrency` of them), never the API's threadpool: a flood of scoring
calls must not starve `GET /v1/videos/{id}`. At most `--score-max-queue` more calls wait for
one of those threads; beyond, `submit` answers 429 at once. A text longer in UTF-8 bytes than
`--score-max-bytes` (default: the model's positions x its longest token in bytes, the most a
text that fits can have) is refused with 413 before it is tokenized or waits for anything.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from pathlib import Path

from longserve.server.api.errors import APIError
from longserve.server.api.protocol import ScoreResponse


class ScoreService:
    def __init__(self, model: str = "tiny-lm", workers: int = 1, strategy: str = "lss", device: str | None = None,
                 dtype: str | None = None, concurrency: int = 1, max_queue: int = 8, max_bytes: int | None = None):
        self.model = model
        self.model_name = Path(str(model).rstrip("/")).name or str(model)
        self.model_names = {self.model_name, str(model)}
        self.workers, self.strategy, self.device, self.dtype = workers, strategy, device, dtype
        self.concurrency, self.max_queue, self.max_bytes = concurrency, max_queue, max_bytes
        self._scorer = None
        self._lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency,
                                                              thread_name_prefix="longserve-score")
        self._in_flight = 0                     # running + waiting calls
        self._count_lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._scorer is not None

    def load(self):
        from longserve.pipelines.scoring import TextScoringPipeline

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

    def byte_limit(self) -> int | None:
        """The longest text in UTF-8 bytes: `max_bytes`, or once the model is loaded, its positions x its longest
        token in bytes (a text of more bytes has more tokens than the model has positions)."""
        if self.max_bytes is not None:
            return self.max_bytes
        scorer = self._scorer
        if scorer is None or scorer.max_positions is None or scorer.tokenizer is None:
            return None
        if not hasattr(self, "_longest_token_bytes"):
            tok = scorer.tokenizer
            pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
            longest = max((len(tok.convert_tokens_to_string([p]).encode("utf-8")) for p in pieces if p), default=1)
            self._longest_token_bytes = max(1, longest)
        return scorer.max_positions * self._longest_token_bytes

    def check_size(self, text) -> None:
        """413 naming `text` when it is longer than `byte_limit()`: a cheap bound, before any tokenizing."""
        limit = self.byte_limit()
        if limit is None or not isinstance(text, str) or len(text) * 4 <= limit:
            return
        size = len(text.encode("utf-8"))
        if size > limit:
            raise APIError(413, f"text is {size} bytes (UTF-8); the limit is {limit} bytes for {self.model_name!r} "
                                f"(--score-max-bytes)", param="text", code="text_too_long")

    def submit(self, text: str) -> concurrent.futures.Future:
        """`score(text)` on the scoring threads; 429 at once when `concurrency + max_queue` calls are in flight."""
        self.check_size(text)
        with self._count_lock:
            if self._in_flight >= self.concurrency + self.max_queue:
                raise APIError(429, f"the scoring queue is full ({self.concurrency} running, {self.max_queue} "
                                    f"waiting); retry later", code="queue_full", headers={"Retry-After": "1"})
            self._in_flight += 1
        try:
            future = self._threads.submit(self.score, text)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return future

    def _done(self, _future) -> None:
        with self._count_lock:
            self._in_flight -= 1

    def score(self, text: str) -> ScoreResponse:
        """Blocking: `submit` runs it on the scoring threads."""
        from longserve.engine.pool import WorkerError
        from longserve.pipelines.scoring import ScoringInputError

        if not text:
            raise APIError(400, "text must not be empty", param="text", code="invalid_value")
        scorer = self.load()
        self.check_size(text)            # the first call learns the model's bound only now
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
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._scorer is not None:
                self._scorer.close()
                self._scorer = None

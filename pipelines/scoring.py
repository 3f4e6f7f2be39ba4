"""TextScoringPipeline: the log-likelihood of a long text under a causal LM, sequence-sharded.

    from longserve.pipelines import TextScoringPipeline
    with TextScoringPipeline.from_pretrained("tiny-lm", workers=2, strategy="lss") as scorer:
        r = scorer.score(text, return_token_logprobs=True)
        r.num_tokens, r.num_bytes, r.total_nll, r.mean_nll, r.perplexity, r.bits_per_byte

What is scored (the lm-evaluation-harness convention):
- the text is tokenized without special tokens; if the tokenizer has a BOS token it is
  prepended (`add_bos=None` means "if it has one"), and every text token is scored,
  the first one conditioned on BOS alone: num_tokens = number of text tokens;
- without BOS the first token has no context and is not scored:
  num_tokens = number of text tokens - 1.
- total_nll = -sum of the natural-log probabilities of the scored tokens (float64);
  mean_nll = total_nll / num_tokens; perplexity = exp(mean_nll);
  bits_per_byte = total_nll / (ln 2 * number of UTF-8 bytes of the text).

Texts longer than the model's positions (`max_position_embeddings`, counting BOS) are
refused unless `window=` and `stride=` ask for sliding-window scoring, with the
semantics of the Hugging Face perplexity guide: windows ids[b:b+window] for
b = 0, stride, 2*stride, ... until a window reaches the end; each window is a fresh
forward (positions 0..window-1) and scores only the tokens after the previous
window's end (its "new" tokens), so every token is scored once, with up to
window - stride tokens of extra context. The first token of a window never has a
prediction inside it, so with stride == window the first token of every window but
the first goes unscored (as in the guide); with stride < window none is lost.
A window at least as long as the text is exactly full scoring.

Every window is itself scored sequence-parallel over the workers (LSS or ring, see
engine/lss.py); `workers=N` gives the same numbers as `workers=1`, and `workers=1`
the same as transformers' own `model(ids, labels=ids).loss * num_tokens`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from longserve.engine import lss, lss_jobs
from longserve.engine.dist import parse_dtype
from longserve.engine.pool import WorkerPool
from longserve.engine.request import RequestError, text_problem

ProgressCallback = Callable[[int, int], None]


class ScoringInputError(RequestError):
    """Bad input to the scoring pipeline; `field` names the argument (for a 4xx reply)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message if field in message else f"{field}: {message}")


@dataclass
class ScoreResult:
    num_tokens: int                          # tokens scored
    num_bytes: int | None                    # UTF-8 bytes of the text (None for score_ids)
    total_nll: float                         # nats, sum over scored tokens
    token_logprobs: list[float] | None = None  # log p of each scored token, in text order
    token_ids: list[int] | None = None         # the scored token ids, aligned with token_logprobs
    strategy: str = "lss"
    zigzag: bool = False
    workers: int = 1
    windows: int = 1
    add_bos: bool = False
    seconds: float = 0.0
    comm: list[dict] = field(default_factory=list)  # per worker: bytes_sent and calls of each collective
    worker_seconds: list[float] = field(default_factory=list)  # per worker: time inside the scoring job
    peak_bytes: list[int] = field(default_factory=list)  # per worker, with measure_memory (engine/memory.py)

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.num_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.mean_nll < 709 else math.inf

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.num_bytes else self.total_nll / (math.log(2) * self.num_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_nll=self.mean_nll, perplexity=self.perplexity, bits_per_byte=self.bits_per_byte)
        return d


def plan_windows(num_ids: int, window: int | None, stride: int | None) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) of each forward over ids (HF perplexity-guide loop)."""
    if window is None or window >= num_ids:
        return [(0, num_ids, 1)]
    windows, prev_end = [], 0
    for begin in range(0, num_ids, stride):
        end = min(begin + window, num_ids)
        windows.append((begin, end, prev_end))  # tokens j >= prev_end (and j > begin) are new here
        prev_end = end
        if end == num_ids:
            break
    return windows


class TextScoringPipeline:
    """Score texts with a causal LM on a pool of workers (see the module docstring)."""

    def __init__(self, pool: WorkerPool, tokenizer, config, *, strategy: str = "lss", zigzag: bool = False,
                 add_bos: bool | None = None, name: str = ""):
        self.pool = pool
        self.tokenizer = tokenizer
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.strategy = _check_strategy(strategy)
        self.zigzag = _check_bool("zigzag", zigzag)
        self.add_bos = add_bos
        self.name = name

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model: str = "tiny-lm", *, workers: int = 1, strategy: str = "lss",
                        zigzag: bool = False, device: str | None = None, dtype: str | None = None,
                        add_bos: bool | None = None) -> "TextScoringPipeline":
        """Load `model` ("tiny-lm" or a local transformers causal-LM directory) on `workers` workers."""
        from transformers import AutoConfig, AutoTokenizer

        from longserve.weights.lm import resolve_causal_lm

        _check_workers(workers)
        _check_strategy(strategy)
        device = _check_device(device)
        parse_dtype(dtype)
        path = resolve_causal_lm(model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.model_max_length = int(1e30)  # length limits are ours to check (and to window)
        config = AutoConfig.from_pretrained(path)
        pool = WorkerPool(workers, setup=lss_jobs.setup_scoring_worker, setup_args=(str(path), None, 0, dtype),
                          device=device)
        return cls(pool.start(), tokenizer, config, strategy=strategy, zigzag=zigzag, add_bos=add_bos,
                   name=str(model))

    @classmethod
    def from_config(cls, config: dict, *, seed: int = 0, workers: int = 1, strategy: str = "lss",
                    zigzag: bool = False, device: str | None = None,
                    dtype: str | None = None) -> "TextScoringPipeline":
        """A model built from a transformers config dict with random weights (no tokenizer:
        use `score_ids`). Every worker builds the same weights from `seed`."""
        from transformers import AutoConfig

        _check_workers(workers)
        _check_strategy(strategy)
        device = _check_device(device)
        parse_dtype(dtype)
        cfg = AutoConfig.for_model(**config)
        pool = WorkerPool(workers, setup=lss_jobs.setup_scoring_worker, setup_args=(None, dict(config), seed, dtype),
                          device=device)
        return cls(pool.start(), None, cfg, strategy=strategy, zigzag=zigzag, name=cfg.model_type)

    @property
    def workers(self) -> int:
        return self.pool.workers

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "TextScoringPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scoring --------------------------------------------------------------------------

    def tokenize(self, text: str) -> tuple[list[int], bool]:
        """(ids to run, whether ids[0] is a prepended BOS)."""
        if self.tokenizer is None:
            raise ScoringInputError("text", "text cannot be scored: this pipeline has no tokenizer "
                                            "(built from a config); use score_ids")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = self.tokenizer.bos_token_id
        add_bos = (bos is not None) if self.add_bos is None else bool(self.add_bos)
        if add_bos:
            if bos is None:
                raise ScoringInputError("add_bos", "add_bos=True but the tokenizer has no BOS token")
            ids = [bos] + ids
        return ids, add_bos

    def score(self, text: str, *, window: int | None = None, stride: int | None = None,
              return_token_logprobs: bool = False, progress: ProgressCallback | bool | None = None,
              strategy: str | None = None, zigzag: bool | None = None, attn_kernel: str | None = None) -> ScoreResult:
        """Score `text` (see the module docstring for what is scored and the window semantics).

        progress: a callable(done, total) called as attention layers finish (total =
        windows x layers), or True for a tqdm bar on stderr.
        Raises ScoringInputError (a ValueError naming the field) on bad input.
        """
        # 1. check inputs
        if not isinstance(text, str):
            raise ScoringInputError("text", f"text must be a string, got {type(text).__name__}")
        if not text:
            raise ScoringInputError("text", "text is empty; give at least one character to score")
        problem = text_problem(text)
        if problem is not None:                  # the tokenizer would raise on the workers' side of the door
            raise ScoringInputError("text", f"text {problem}")
        # 2. tokenize (BOS convention)
        ids, add_bos = self.tokenize(text)
        # 3. score
        result = self.score_ids(ids, window=window, stride=stride, return_token_logprobs=return_token_logprobs,
                                progress=progress, strategy=strategy, zigzag=zigzag, attn_kernel=attn_kernel,
                                _field="text")
        result.num_bytes = len(text.encode("utf-8"))
        result.add_bos = add_bos
        return result

    __call__ = score

    def score_ids(self, ids, *, window: int | None = None, stride: int | None = None,
                  return_token_logprobs: bool = False, progress: ProgressCallback | bool | None = None,
                  strategy: str | None = None, zigzag: bool | None = None, measure_memory: bool = False,
                  attn_kernel: str | None = None, _field: str = "ids") -> ScoreResult:
        """Score token ids as given (no BOS added): every id but the first is scored.

        attn_kernel: "sdpa" (torch's SDPA kernels, the CUDA default), "blocks" (an online-softmax loop
        over (query x key) blocks, the CPU default), or None for the device's default (engine/lss.py).

        measure_memory: also report each worker's peak activation memory (`peak_bytes`,
        see engine/memory.py; on CPU it slows the run down a little).
        """
        # 1. check inputs
        strategy = self.strategy if strategy is None else _check_strategy(strategy)
        zigzag = self.zigzag if zigzag is None else _check_bool("zigzag", zigzag)
        if attn_kernel is not None and attn_kernel not in lss.ATTN_KERNELS:
            raise ScoringInputError("attn_kernel", f"attn_kernel must be one of {', '.join(lss.ATTN_KERNELS)} or "
                                                   f"None (the device's default), got {attn_kernel!r}")
        ids = _check_ids(ids, _field, getattr(self.config, "vocab_size", None))
        windows = self._plan(len(ids), window, stride, _field)
        # 2. run on the workers
        job = lss_jobs.ScoreJob(ids=ids, windows=windows, strategy=strategy, zigzag=zigzag,
                           return_logprobs=bool(return_token_logprobs), measure_memory=bool(measure_memory),
                           attn_kernel=attn_kernel)
        t0 = time.perf_counter()
        with _progress_sink(progress, len(windows) * self.num_layers) as on_event:
            shards = self.pool.run(lss_jobs.score_tokens_job, job, on_event=on_event)
        seconds = time.perf_counter() - t0
        # 3. assemble: totals are already reduced; per-token details come from every rank
        result = ScoreResult(num_tokens=shards[0].num_tokens, num_bytes=None, total_nll=shards[0].total_nll,
                             strategy=strategy, zigzag=zigzag, workers=self.workers, windows=len(windows),
                             seconds=seconds, comm=[s.comm for s in shards],
                             worker_seconds=[s.seconds for s in shards],
                             peak_bytes=[s.peak_bytes for s in shards] if measure_memory else [])
        if return_token_logprobs:
            index = torch.cat([s.target_index for s in shards])
            logprobs = torch.cat([s.logprobs for s in shards])
            order = index.argsort()
            result.token_logprobs = logprobs[order].tolist()
            result.token_ids = ids[index[order]].tolist()
        return result

    def reference_score_ids(self, ids, measure_memory: bool = False) -> dict:
        """Baseline: transformers' own full-sequence scoring, `model(ids, labels=ids)` with its
        default (SDPA) attention and full logits, run on each worker independently (meant
        for workers=1). Returns rank 0's total_nll, num_tokens, seconds, peak_bytes."""
        ids = _check_ids(ids, "ids", getattr(self.config, "vocab_size", None))
        return self.pool.run(lss_jobs.reference_score_job, ids, bool(measure_memory))[0]

    def _plan(self, n: int, window, stride, field: str) -> list[tuple[int, int, int]]:
        if window is None:
            if stride is not None:
                raise ScoringInputError("stride", "stride needs window= as well (sliding-window scoring)")
            if self.max_positions is not None and n > self.max_positions:
                raise ScoringInputError(
                    field, f"{field} is {n} tokens long, more than the model's limit of {self.max_positions} positions "
                    f"(max_position_embeddings); pass window= and stride= (CLI: --window, --stride) for "
                    "sliding-window scoring")
            return plan_windows(n, None, None)
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ScoringInputError("window", f"window must be an integer >= 2, got {window!r}")
        if self.max_positions is not None and window > self.max_positions:
            raise ScoringInputError("window", f"window={window} exceeds the model's limit of {self.max_positions} "
                                              "positions "
                                              "(max_position_embeddings)")
        if stride is None:
            raise ScoringInputError("stride", "stride is required with window= (tokens to advance per window)")
        if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
            raise ScoringInputError("stride", f"stride must be an integer in [1, window={window}], got {stride!r}")
        return plan_windows(n, window, stride)


# -- input checks ----------------------------------------------------------------------------


def _check_workers(workers) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ScoringInputError("workers", f"workers must be a positive integer, got {workers!r}")
    return workers


def _check_strategy(strategy) -> str:
    if strategy not in lss.STRATEGIES:
        raise ScoringInputError("strategy", f"strategy must be one of {', '.join(lss.STRATEGIES)}, got {strategy!r}")
    return strategy


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ScoringInputError(name, f"{name} must be true or false, got {value!r}")
    return value


def _check_device(device) -> str | None:
    if device is None:
        return None
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ScoringInputError("device", f"device must be 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ScoringInputError("device", "device='cuda' was asked for but CUDA is not available")
    return device.split(":")[0]


def _check_ids(ids, field: str, vocab_size: int | None) -> torch.Tensor:
    try:
        t = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise ScoringInputError(field, f"{field} must be a sequence of integer token ids") from None
    if t.numel() < 2:
        raise ScoringInputError(field, f"{field} needs at least 2 tokens to score one (got {t.numel()})")
    if vocab_size is not None and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ScoringInputError(field, f"{field}: token ids must lie in [0, {vocab_size})")
    return t


class _progress_sink:
    """Turn worker progress events into `progress(done, total)` calls (or a tqdm bar)."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.bar = progress, total, None

    def __enter__(self):
        if self.progress is None or self.progress is False:
            return None
        if self.progress is True:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, unit="layer", desc="scoring", leave=False)
            callback = lambda done, total: self.bar.update(done - self.bar.n)  # noqa: E731
        else:
            callback = self.progress

        def on_event(event: dict) -> None:
            done = (event["window"] - 1) * event["layers"] + event["layer"]
            callback(done, self.total)

        return on_event

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

"""LSS scoring's worker jobs (`engine/lss.py` holds the sharded attention they run under): a worker loads the
causal LM (`setup_scoring_worker`); `score_tokens_job` scores a window of tokens sharded across the workers, shifting
labels before sharding and reducing NLL sums and token counts in one float64 all-reduce; `reference_score_job` is
the one-worker, unsharded reference it is compared with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from longserve.engine import comm
from longserve.engine.lss import (
    CUDA_ATTN_CHUNK_ELEMS,
    CUDA_LOGITS_CHUNK_ELEMS,
    CUDA_MLP_CHUNK_TOKENS,
    DEFAULT_ATTN_CHUNK_ELEMS,
    DEFAULT_LOGITS_CHUNK_ELEMS,
    DEFAULT_MLP_CHUNK_TOKENS,
    LSSContext,
    SequenceLayout,
    chunked_mlp,
    default_attn_kernel,
    load_causal_lm,
    lss_context,
    output_head,
)
from longserve.engine.memory import PeakMemory


def setup_scoring_worker(ctx, path: str | None, config: dict | None = None, seed: int = 0,
                         dtype: str | None = None) -> None:
    """WorkerPool setup: load the model once into ctx.state."""
    ctx.state["model"] = load_causal_lm(path, config, seed, ctx.pg.device, dtype)


@dataclass
class ScoreJob:
    """One text's token ids and how to score them.

    `windows`: (begin, end, first_scored) triples over `ids`. Each window is one forward
    over ids[begin:end] with positions 0..end-begin-1; in it, token j (begin < j < end)
    is a target iff j >= first_scored. A single full-length window (0, len, 1) scores
    every token but the first.
    """

    ids: torch.Tensor                       # (T,) int64
    windows: list[tuple[int, int, int]]
    strategy: str = "lss"
    zigzag: bool = False
    return_logprobs: bool = False
    measure_memory: bool = False
    attn_chunk_elems: int | None = None      # None: DEFAULT_* on CPU, CUDA_* on CUDA
    logits_chunk_elems: int | None = None
    mlp_chunk_tokens: int | None = None      # 0: no MLP chunking
    attn_kernel: str | None = None           # None: default_attn_kernel(device)

    def resolved(self, device) -> "ScoreJob":
        """This job with every automatic (None) setting chosen for `device`."""
        import dataclasses

        cuda = torch.device(device).type == "cuda"
        pick = lambda value, cpu, gpu: (gpu if cuda else cpu) if value is None else value  # noqa: E731
        return dataclasses.replace(
            self,
            attn_chunk_elems=pick(self.attn_chunk_elems, DEFAULT_ATTN_CHUNK_ELEMS, CUDA_ATTN_CHUNK_ELEMS),
            logits_chunk_elems=pick(self.logits_chunk_elems, DEFAULT_LOGITS_CHUNK_ELEMS, CUDA_LOGITS_CHUNK_ELEMS),
            mlp_chunk_tokens=pick(self.mlp_chunk_tokens, DEFAULT_MLP_CHUNK_TOKENS, CUDA_MLP_CHUNK_TOKENS),
            attn_kernel=self.attn_kernel or default_attn_kernel(device))


@dataclass
class ScoreShard:
    """What one worker returns: the reduced totals, and its own part of the details."""

    total_nll: float
    num_tokens: int
    target_index: torch.Tensor | None      # (n,) index j in ids of each token this rank scored
    logprobs: torch.Tensor | None          # (n,) float64 log p(ids[j] | ids[:j]) (within its window)
    comm: dict = field(default_factory=dict)
    peak_bytes: int = 0
    memory_method: str = "off"
    seconds: float = 0.0


def shifted_targets(ids: torch.Tensor, begin: int, end: int, first_scored: int) -> torch.Tensor:
    """(end-begin,) targets of window ids[begin:end]: row i predicts ids[begin+i+1], or -100.

    Shifted BEFORE sharding, so the target of a segment's last row (the next segment's
    first token) is never lost.
    """
    W = end - begin
    targets = torch.full((W,), -100, dtype=torch.long)
    first_row = max(first_scored, begin + 1) - begin - 1
    if first_row < W - 1:
        targets[first_row:W - 1] = ids[begin + first_row + 1:end]
    return targets


@torch.inference_mode()
def score_tokens_job(ctx, job: ScoreJob) -> ScoreShard:
    """Worker job: LSS/ring-sharded scoring of `job.ids`; every rank returns the totals."""
    pg = ctx.pg
    job = job.resolved(pg.device)
    model = ctx.state["model"]
    base = model.base_model
    logits_of = output_head(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    num_layers = model.config.get_text_config().num_hidden_layers
    dev = pg.device
    comm.STATS.reset()
    t0 = time.perf_counter()
    nll_local = torch.zeros((), dtype=torch.float64)
    count_local = 0
    index_parts, logprob_parts = [], []
    with PeakMemory(dev, enabled=job.measure_memory) as mem, chunked_mlp(model, job.mlp_chunk_tokens):
        for w, (begin, end, first_scored) in enumerate(job.windows):
            layout = SequenceLayout(end - begin, pg.world_size, job.zigzag)
            pos = layout.positions(pg.rank)                                   # (l,) window positions
            window_ids = comm.pad_dim(job.ids[begin:end], 0, layout.padded_length)  # (P,), padding id 0
            targets = torch.full((layout.padded_length,), -100, dtype=torch.long)  # (P,), padding -> -100
            targets[:end - begin] = shifted_targets(job.ids, begin, end, first_scored)
            local_ids, local_targets = window_ids[pos], targets[pos]          # (l,), (l,)

            def on_layer(i, w=w):
                if pg.is_first:
                    ctx.emit({"window": w + 1, "windows": len(job.windows), "layer": i, "layers": num_layers})

            lctx = LSSContext(pg, layout, job.strategy, job.attn_chunk_elems, on_layer, attn_kernel=job.attn_kernel)
            with lss_context(lctx):
                hidden = base(input_ids=local_ids[None].to(dev), position_ids=pos[None].to(dev),
                              use_cache=False).last_hidden_state             # (1, l, C)
            rows = (local_targets >= 0).nonzero().squeeze(1)                   # local rows with a target
            chunk = max(1, job.logits_chunk_elems // vocab)
            for a in range(0, rows.numel(), chunk):
                r = rows[a:a + chunk]
                logp = torch.log_softmax(logits_of(hidden[0, r.to(dev)]), dim=-1)          # (n, V) fp32
                lp = logp.gather(1, local_targets[r].to(dev)[:, None])[:, 0].double().cpu()  # (n,)
                del logp
                nll_local -= lp.sum()
                count_local += r.numel()
                if job.return_logprobs:
                    index_parts.append(begin + pos[r] + 1)
                    logprob_parts.append(lp)
            del hidden
    totals = comm.all_reduce(torch.stack([nll_local, torch.tensor(float(count_local), dtype=torch.float64)]).to(dev),
                             pg).cpu()                                         # [nll_sum, count]: ONE float64 reduce
    seconds = time.perf_counter() - t0

    def cat(parts, dt):
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dt)

    return ScoreShard(
        total_nll=float(totals[0]),
        num_tokens=int(round(float(totals[1]))),
        target_index=cat(index_parts, torch.long) if job.return_logprobs else None,
        logprobs=cat(logprob_parts, torch.float64) if job.return_logprobs else None,
        comm=comm.STATS.snapshot(),
        peak_bytes=mem.peak_bytes,
        memory_method=mem.method,
        seconds=seconds,
    )


@torch.inference_mode()
def reference_score_job(ctx, ids: torch.Tensor, measure_memory: bool = False) -> dict:
    """Worker job (1 worker): transformers' own full-sequence scoring, the baseline.

    model(input_ids, labels=input_ids) with transformers' default attention (SDPA) and
    full logits; total NLL = its mean loss x (T - 1).
    """
    model = ctx.state["model"]
    dev = ctx.pg.device
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        x = ids[None].to(dev)
        t0 = time.perf_counter()
        with PeakMemory(dev, enabled=measure_memory) as mem:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            total = float(loss.double()) * (ids.numel() - 1)
            del loss
        seconds = time.perf_counter() - t0
    finally:
        model.set_attn_implementation(previous)
    return {"total_nll": total, "num_tokens": ids.numel() - 1, "peak_bytes": mem.peak_bytes,
            "memory_method": mem.method, "seconds": seconds}

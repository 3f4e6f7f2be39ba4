"""LSS: sequence-sharded causal-LM scoring (arXiv 2311.02382), and its ring variant.

The model is transformers' own (`AutoModelForCausalLM`, any architecture that calls
attention through transformers' `AttentionInterface`: Llama, Qwen2, Mistral, ...).
This module adds one thing around it: an attention function, registered under
`ATTN_IMPLEMENTATION`, that makes a worker holding a segment of the sequence compute
exact causal attention against every key of the sequence:

- every worker runs the model on its own tokens with their GLOBAL position ids
  (RoPE sees true positions; `SequenceLayout` says which positions a rank holds:
  contiguous, or zigzag = chunks r and 2N-1-r of 2N for causal load balance);
- strategy "lss": in every attention layer each worker's K and V travel together in
  ONE fused all-gather (K/V heads un-repeated: GQA saves bytes), then each worker
  attends with its own queries to all keys;
- strategy "ring": K/V blocks go around the ring in N-1 `ring_shift` steps; each
  block's partial attention is merged by log-sum-exp (online softmax), so a worker
  holds at most two blocks, O(length/N), never the full K/V;
- the causal mask compares global positions (key position <= query position; a
  top-left `is_causal=True` is wrong when Lq != Lk); padding positions (length not
  divisible by N) lie past the end, are cut out of every key block and are never
  attended from;
- attention runs in (query chunk x key chunk) blocks with the online softmax, so no
  (L_local x L_full) score matrix exists; blocks wholly in the future are skipped;
- GQA: queries are grouped by the KV head they share ((B, H, l, D) -> (B*H_kv, rep,
  l, D)), which computes exactly `repeat_kv` attention without materialising the
  repeated keys.

Scoring (`engine/lss_jobs.py`, `score_tokens_job`) shifts labels before sharding, runs the model's base
model, and computes log-softmax with the model's own output head in chunks of tokens
(never full-vocabulary logits for the whole segment); NLL sums and token counts are
reduced together in one float64 all-reduce.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable

import torch

from longserve.engine import comm
from longserve.engine.dist import ParallelGroup, parse_dtype

ATTN_IMPLEMENTATION = "longserve_lss"
STRATEGIES = ("lss", "ring")
ATTN_KERNELS = ("blocks", "sdpa")

DEFAULT_ATTN_CHUNK_ELEMS = 1 << 20   # scores per (query chunk x key chunk) block, all heads: 4 MiB fp32
DEFAULT_LOGITS_CHUNK_ELEMS = 1 << 19  # logits per chunk of tokens: 2 MiB fp32
DEFAULT_MLP_CHUNK_TOKENS = 512

# On CUDA the CPU-sized chunks make the GPU wait on Python: with a 128k-token vocabulary a 2 MiB logits
# chunk is 4 tokens, and a 4 MiB score block of a 32-head model is 64 x 512 (first seen on an H100,
# docs/gpu.md). CUDA chunks are sized for launch count, not for a few MiB of host memory.
CUDA_ATTN_CHUNK_ELEMS = 1 << 26      # 256 MiB fp32 of scores per block (ring / "blocks" on CUDA)
CUDA_LOGITS_CHUNK_ELEMS = 1 << 28    # 1 GiB fp32 of logits per chunk (about 2k tokens at a 128k vocabulary)
CUDA_MLP_CHUNK_TOKENS = 8192


def default_attn_kernel(device) -> str:
    """"sdpa" on CUDA (torch's flash / memory-efficient kernels), "blocks" elsewhere (the online-softmax
    loop, whose CPU peak memory is what docs/benchmarks.md reports)."""
    return "sdpa" if torch.device(device).type == "cuda" else "blocks"


# -- which positions a rank holds ------------------------------------------------


@dataclass(frozen=True)
class SequenceLayout:
    """How `length` positions are split over `world_size` ranks (padded to equal shards).

    Contiguous: rank r holds positions [r*c, (r+1)*c), c = ceil(length/N).
    Zigzag:     rank r holds chunks r and 2N-1-r of 2N chunks of c = ceil(length/2N).
    Positions >= length are padding (they exist only at the end of the padded sequence).
    """

    length: int
    world_size: int
    zigzag: bool = False

    @property
    def num_chunks(self) -> int:
        return 2 * self.world_size if self.zigzag else self.world_size

    @property
    def chunk(self) -> int:
        return max(1, comm.shard_size(self.length, self.num_chunks))

    @property
    def padded_length(self) -> int:
        return self.chunk * self.num_chunks

    @property
    def local_length(self) -> int:
        return self.padded_length // self.world_size

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """[start, stop) position ranges held by `rank`, in local order (padding included)."""
        c = self.chunk
        chunks = [rank, 2 * self.world_size - 1 - rank] if self.zigzag else [rank]
        return [(i * c, (i + 1) * c) for i in chunks]

    def positions(self, rank: int) -> torch.Tensor:
        """(local_length,) global position of each local row."""
        return torch.cat([torch.arange(a, b) for a, b in self.ranges(rank)])

    def segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(local offset, first position, number of real tokens) of each range, padding cut off."""
        out, offset = [], 0
        for a, b in self.ranges(rank):
            n = max(0, min(b, self.length) - a)
            if n:
                out.append((offset, a, n))
            offset += b - a
        return out


# -- the context an attention call runs in ----------------------------------------


@dataclass
class LSSContext:
    """What the attention function needs to know about the current sharded forward."""

    pg: ParallelGroup
    layout: SequenceLayout
    strategy: str = "lss"
    attn_chunk_elems: int = DEFAULT_ATTN_CHUNK_ELEMS
    on_layer: Callable[[int], None] | None = None  # called after each attention layer
    layers_done: int = 0
    attn_kernel: str = "blocks"  # "sdpa": strategy "lss" attends with torch's SDPA kernels (see sdpa_segments)


_CONTEXT: contextvars.ContextVar[LSSContext | None] = contextvars.ContextVar("lss_context", default=None)


@contextlib.contextmanager
def lss_context(ctx: LSSContext):
    """Run model forwards inside this block as one sharded LSS forward described by `ctx`."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def _single_process_context(length: int, device: torch.device) -> LSSContext:
    # Outside `lss_context` the model is an ordinary single-process causal LM.
    return LSSContext(ParallelGroup(rank=0, world_size=1, device=device), SequenceLayout(length, 1))


# -- blockwise attention with an online softmax -------------------------------------


class OnlineSoftmaxAttention:
    """Exact attention of a rank's queries, accumulated over key blocks in any order.

    Queries are grouped by KV head: q (B, H, l, D) is read as (B*H_kv, rep, l, D), and
    every KV head's keys serve its `rep` query heads (what `repeat_kv` computes).
    State per query row: running max `m`, running sum `s` of exp(score - m), and
    `acc` = sum of exp(score - m) * v, all fp32. `finish()` returns acc / s.
    """

    def __init__(self, query: torch.Tensor, num_kv_heads: int, q_segments, scale: float,
                 sliding_window: int | None, chunk_elems: int):
        B, H, l, D = query.shape
        self.query = query
        self.B, self.H, self.l, self.D = B, H, l, D
        self.G = B * num_kv_heads                    # independent (batch, KV head) groups
        self.rep = H // num_kv_heads                 # query heads per KV head
        self.q_segments = q_segments
        self.scale = scale
        self.window = sliding_window
        # (q_chunk x k_chunk) blocks of B*H scores, <= chunk_elems (powers of two, >= 8);
        # long key blocks keep the Python loop short, short query blocks keep a block small.
        pow2 = lambda x: 1 << (max(1, int(x)).bit_length() - 1)  # noqa: E731
        self.k_chunk = max(8, min(1024, pow2(chunk_elems // (B * H * 64))))
        self.q_chunk = max(8, pow2(chunk_elems // (B * H * self.k_chunk)))
        dev = query.device
        self.m = torch.full((self.G, self.rep, l), float("-inf"), device=dev)  # (G, rep, l)
        self.s = torch.zeros((self.G, self.rep, l), device=dev)                # (G, rep, l)
        self.acc = torch.zeros((self.G, self.rep, l, D), device=dev)           # (G, rep, l, D)

    def add_block(self, kv: torch.Tensor, k_segments) -> None:
        """Attend to one block of keys/values. kv: (Lk, 2, B, H_kv, D), rows at `k_segments`."""
        qc, kc, G, rep, D = self.q_chunk, self.k_chunk, self.G, self.rep, self.D
        for q_off, q_pos0, q_len in self.q_segments:
            for qa in range(0, q_len, qc):
                n = min(qc, q_len - qa)
                q_lo, q_hi = q_pos0 + qa, q_pos0 + qa + n - 1          # positions of this query chunk
                rows = slice(q_off + qa, q_off + qa + n)
                q = self.query[:, :, rows].reshape(G, rep * n, D)       # (G, rep*n, D)
                m, s, acc = self.m[:, :, rows], self.s[:, :, rows], self.acc[:, :, rows]
                for k_off, k_pos0, k_len in k_segments:
                    for ka in range(0, k_len, kc):
                        k_lo = k_pos0 + ka
                        if k_lo > q_hi:
                            break                                   # this and later keys are all in the future
                        mk = min(kc, k_len - ka)
                        k_hi = k_lo + mk - 1
                        if self.window is not None and q_lo - k_hi >= self.window:
                            continue                                # all keys out of every query's window
                        block = kv[k_off + ka:k_off + ka + mk]      # (mk, 2, B, H_kv, D)
                        k = block[:, 0].reshape(mk, G, D).permute(1, 2, 0)  # (G, D, mk)
                        v = block[:, 1].reshape(mk, G, D).transpose(0, 1)   # (G, mk, D)
                        scores = torch.bmm(q, k.to(q.dtype)).float()        # (G, rep*n, mk)
                        scores = scores.mul_(self.scale).view(G, rep, n, mk)
                        masked = k_hi > q_lo or (self.window is not None and q_hi - k_lo >= self.window)
                        if masked:
                            qp = torch.arange(q_lo, q_hi + 1, device=q.device)[:, None]  # (n, 1)
                            kp = torch.arange(k_lo, k_hi + 1, device=q.device)[None, :]  # (1, mk)
                            allowed = kp <= qp                                           # (n, mk)
                            if self.window is not None:
                                allowed &= (qp - kp) < self.window
                            scores.masked_fill_(~allowed, float("-inf"))
                        m_new = torch.maximum(m, scores.amax(dim=-1))                   # (G, rep, n)
                        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)          # rows with no key yet
                        p = scores.sub_(m_safe[..., None]).exp_()                       # (G, rep, n, mk)
                        correction = torch.exp(m - m_safe)                              # (G, rep, n)
                        s = s * correction + p.sum(dim=-1)
                        pv = torch.bmm(p.view(G, rep * n, mk).to(v.dtype), v)           # (G, rep*n, D)
                        acc = acc * correction[..., None] + pv.float().view(G, rep, n, D)
                        m = m_new
                        del scores, p, pv                           # free before the next block allocates
                self.m[:, :, rows], self.s[:, :, rows], self.acc[:, :, rows] = m, s, acc

    def finish(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, l, H, D) attention output; rows that attended to nothing (padding) are 0."""
        out = self.acc.div_(self.s.clamp_min_(1e-30)[..., None])   # (G, rep, l, D)
        out = out.view(self.B, self.H, self.l, self.D).transpose(1, 2)  # (B, l, H, D)
        return out.to(dtype).contiguous()


def _fuse_kv(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, l, D) x 2 -> (l, 2, B, H_kv, D): one contiguous tensor, sequence first."""
    return torch.stack((key, value)).permute(3, 0, 1, 2, 4).contiguous()


def gathered_rows(layout: SequenceLayout, device) -> torch.Tensor | None:
    """(length,) row of the all-gathered K/V (rank r's rows at r*l ...) holding each position, in position
    order; None when that is the identity (contiguous layout: rank r holds positions [r*l, (r+1)*l))."""
    if not layout.zigzag:
        return None
    rows = torch.empty(layout.length, dtype=torch.long)
    l = layout.local_length
    for r in range(layout.world_size):
        for off, p0, n in layout.segments(r):
            rows[p0:p0 + n] = torch.arange(r * l + off, r * l + off + n)
    return rows.to(device)


def sdpa_segments(query: torch.Tensor, kv_all: torch.Tensor, layout: SequenceLayout, rank: int,
                  scale: float) -> torch.Tensor:
    """Exact causal attention of this rank's queries with torch's SDPA, one call per query segment.

    A segment holds the queries of positions [p0, p0 + n); the keys any of them may see are exactly
    positions [0, p0 + n), so one SDPA call per segment over that key prefix (in position order) with
    a *lower-right* causal mask (`causal_lower_right(n, p0 + n)`: query i sees keys <= p0 + i; the
    top-left `is_causal=True` would be wrong whenever p0 > 0). On CUDA that runs the flash or
    memory-efficient kernel (no score matrix in memory). K/V heads are repeated for grouped-query
    models (the lower-right path of torch's SDPA takes no `enable_gqa`). Padding rows give 0.

    query (B, H, l, D); kv_all (N*l, 2, B, H_kv, D) -> (B, l, H, D)
    """
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    B, H, l, D = query.shape
    rep = H // kv_all.shape[3]
    rows = gathered_rows(layout, kv_all.device)
    out = query.new_zeros((B, l, H, D))
    for q_off, p0, n in layout.segments(rank):
        keys = kv_all[:p0 + n] if rows is None else kv_all.index_select(0, rows[:p0 + n])  # (Lk, 2, B, H_kv, D)
        k, v = (keys[:, i].permute(1, 2, 0, 3) for i in (0, 1))                       # (B, H_kv, Lk, D) each
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # (B, H, Lk, D)
        q = query[:, :, q_off:q_off + n]                                              # (B, H, n, D)
        if _get_current_dispatch_mode() is None:
            mask = causal_lower_right(n, p0 + n)
        else:
            # under a TorchDispatchMode (engine/memory.py's CPU tracker) the CausalBias tensor subclass
            # cannot be created: the same mask, materialised (n, p0 + n) bool
            mask = torch.ones(n, p0 + n, dtype=torch.bool, device=q.device).tril_(diagonal=p0)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
        out[:, q_off:q_off + n] = o.transpose(1, 2)                                   # (B, n, H, D)
        del keys, k, v, o
    return out


def lss_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention function: query (B, H, l, D), key/value (B, H_kv, l, D) ->
    ((B, l, H, D), None), exact causal attention over the whole sharded sequence."""
    if softcap is not None or s_aux is not None:
        raise NotImplementedError("LSS attention supports neither attention logit softcapping nor attention sinks")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("LSS attention is for causal (decoder) self-attention only")
    ctx = _CONTEXT.get() or _single_process_context(query.shape[2], query.device)
    pg, layout = ctx.pg, ctx.layout
    if query.shape[2] != layout.local_length:
        raise RuntimeError(f"LSS: local query length {query.shape[2]} != layout's {layout.local_length}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    num_kv_heads = key.shape[1]
    attn = OnlineSoftmaxAttention(query, num_kv_heads, layout.segments(pg.rank), scale, sliding_window,
                                  ctx.attn_chunk_elems)
    kv = _fuse_kv(key, value)                                          # (l, 2, B, H_kv, D)
    l = layout.local_length
    if ctx.strategy == "lss" and ctx.attn_kernel == "sdpa" and sliding_window is None:
        kv_all = comm.all_gather(kv, 0, pg)                            # (N*l, 2, B, H_kv, D): ONE collective
        del kv
        out = sdpa_segments(query, kv_all, layout, pg.rank, scale)     # (B, l, H, D)
        del kv_all
        ctx.layers_done += 1
        if ctx.on_layer is not None:
            ctx.on_layer(ctx.layers_done)
        return out, None
    if ctx.strategy == "lss":
        kv_all = comm.all_gather(kv, 0, pg)                            # (N*l, 2, B, H_kv, D): ONE collective
        del kv                                                         # only the gathered copy is needed now
        k_segments = [(r * l + off, p0, n) for r in range(pg.world_size) for off, p0, n in layout.segments(r)]
        k_segments.sort(key=lambda seg: seg[1])                        # position order: key 0 first
        attn.add_block(kv_all, k_segments)
        del kv_all
    elif ctx.strategy == "ring":
        for step in range(pg.world_size):
            src = (pg.rank - step) % pg.world_size                     # whose block we hold now
            attn.add_block(kv, layout.segments(src))
            if step < pg.world_size - 1:
                kv = comm.ring_shift(kv, pg)                           # (l, 2, B, H_kv, D) from rank-1
    else:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {ctx.strategy!r}")
    out = attn.finish(query.dtype)                                     # (B, l, H, D)
    ctx.layers_done += 1
    if ctx.on_layer is not None:
        ctx.on_layer(ctx.layers_done)
    return out, None


def register() -> str:
    """Register the LSS attention function with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, lss_attention_forward)
    return ATTN_IMPLEMENTATION


# -- memory helpers around the model's own modules -----------------------------------


@contextlib.contextmanager
def chunked_mlp(model: torch.nn.Module, chunk_tokens: int | None):
    """Run every decoder layer's `mlp` (a token-wise module) on chunks of `chunk_tokens` tokens.

    Same module, same weights, same per-token result; only the (l, intermediate)
    activations exist one chunk at a time (the Mini-Sequence Transformer idea).
    """
    if not chunk_tokens:
        yield
        return
    patched = []
    for name, module in model.named_modules():
        if name.endswith(".mlp") and "forward" not in vars(module):
            original = module.forward

            def forward(x, *args, _orig=original, **kwargs):
                if args or kwargs or x.dim() < 2 or x.shape[-2] <= chunk_tokens:
                    return _orig(x, *args, **kwargs)
                first = _orig(x[..., :chunk_tokens, :])
                if not isinstance(first, torch.Tensor) or first.shape[:-1] != x[..., :chunk_tokens, :].shape[:-1]:
                    return _orig(x)                                    # not token-wise (e.g. MoE tuples)
                out = first.new_empty((*x.shape[:-1], first.shape[-1]))  # (B, l, C)
                out[..., :chunk_tokens, :] = first
                del first
                for a in range(chunk_tokens, x.shape[-2], chunk_tokens):
                    out[..., a:a + chunk_tokens, :] = _orig(x[..., a:a + chunk_tokens, :])
                return out

            module.forward = forward
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def output_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden (n, C) -> logits (n, V) in fp32, by the model's own output embedding."""
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)

    def logits(h: torch.Tensor) -> torch.Tensor:
        z = head(h).float()
        if cap:
            z = torch.tanh(z / cap) * cap
        return z

    return logits


# -- loading -----------------------------------------------------------------------------


def load_causal_lm(path: str | None = None, config: dict | None = None, seed: int = 0,
                   device: torch.device | str = "cpu", dtype: str | torch.dtype | None = None):
    """The transformers causal LM at `path` (or built from `config` with random weights),
    in eval mode, with LSS attention, checked to score through its base model and head."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    register()
    torch_dtype = parse_dtype(dtype)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch_dtype)
    else:
        cfg = AutoConfig.for_model(**config)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch_dtype)
    model = model.to(device).eval()
    _check_scores_through_head(model)
    return model


@torch.inference_mode()
def _check_scores_through_head(model) -> None:
    # Scoring runs base_model then the output head in chunks; a model whose logits are
    # something else (extra scaling, ...) would be scored wrongly, so refuse it here.
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(8, device=model.device) * 7 % vocab)[None]
    full = model(input_ids=ids, use_cache=False).logits.float()
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    mine = output_head(model)(hidden)
    if not torch.allclose(full, mine, rtol=1e-3, atol=1e-3):
        raise ValueError(f"model {type(model).__name__}: its logits are not its output embedding applied to its "
                         "base model's last hidden state; LSS scoring does not support it")

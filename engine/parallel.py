"""Parallel plans and the sequence-parallel attention they share.

A plan says how one denoising forward is split across the N workers of a group:

- "dsp", "ulysses", "ring", "megatron-sp" for spatial-temporal DiTs (Latte; see
  `engine/families/latte.py`, which implements them around Latte's blocks);
- "ulysses", "ring", "usp" for full-attention DiTs (Wan, SkyReels-V2): the sequence of
  F x H x W tokens rests sharded N ways; inside self-attention
  * ulysses: one all-to-all trades the sequence shard for a head shard (Q, K, V fused
    into one collective), every rank attends over the whole sequence with H/N heads, one
    all-to-all trades back. Heads that do not divide by N are zero-padded.
  * ring: K/V blocks travel around the ring in N-1 steps; softmaxes merge by log-sum-exp.
  * usp (Unified Sequence Parallelism): Ulysses inside groups of k = `ulysses_degree`
    consecutive ranks, Ring across the N/k groups (k x ring = N).
- `cfg_parallel` composes with every plan: the unconditional and conditional halves of
  classifier-free guidance run on two halves of the workers, each half running the plan.

Shapes: B batch, S tokens (padded shard `Sl = ceil(S/N)`), H heads (`Hl` padded shard),
hd head dim. Rank r holds tokens [r*Sl, (r+1)*Sl); padded tokens on the last ranks are
never attended to as keys and are dropped when the output is gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longserve.engine import comm
from longserve.engine.attention import attend
from longserve.engine.dist import ParallelGroup


@dataclass(frozen=True)
class ParallelPlan:
    """How a forward is split. `ulysses_degree` is the Ulysses group size k of "usp" (ring degree N/k)."""

    name: str
    cfg_parallel: bool = False
    ulysses_degree: int | None = None

    def describe(self) -> str:
        text = self.name if self.name != "usp" else f"usp(ulysses={self.ulysses_degree})"
        return text + ("+cfg" if self.cfg_parallel else "")


def resolve_plan(parallel: str, supported: tuple[str, ...], workers: int, heads: int, auto: str,
                 ulysses_degree: int | None = None, cfg_parallel: bool = False) -> ParallelPlan:
    """Validate a requested plan against what a family supports (ValueError naming the options).

    `auto` is the family's preferred plan for "auto": "dsp" or "sequence" (Ulysses when the
    heads cover the sequence-parallel group, else USP with the largest Ulysses degree that
    divides the group and does not exceed the heads; a degree of 1 is plain Ring).
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if cfg_parallel and workers % 2:
        raise ValueError(f"cfg_parallel needs an even number of workers, got workers={workers}")
    group = workers // 2 if cfg_parallel else workers        # the sequence-parallel group of one CFG half
    if parallel == "auto":
        if auto != "sequence":
            parallel = auto
        elif heads >= group:
            parallel = "ulysses"
        else:
            k = max(d for d in range(1, group + 1) if group % d == 0 and d <= heads)
            parallel, ulysses_degree = ("ring", None) if k == 1 else ("usp", k)
    if parallel not in supported:
        raise ValueError(f"parallel must be 'auto' or one of {', '.join(supported)} for this model; got {parallel!r}")
    if parallel == "usp":
        if ulysses_degree is None:
            k = max(d for d in range(1, group + 1) if group % d == 0 and d <= max(1, heads))
            ulysses_degree = k
        if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1 \
                or group % ulysses_degree:
            raise ValueError(f"ulysses_degree must be a positive divisor of the sequence-parallel group size "
                             f"{group}; got {ulysses_degree!r}")
    elif ulysses_degree not in (None, 1) and parallel != "usp":
        raise ValueError(f"ulysses_degree applies to parallel='usp' only; got parallel={parallel!r}")
    return ParallelPlan(parallel, cfg_parallel, ulysses_degree if parallel == "usp" else None)


# -- worker groups --------------------------------------------------------------------------


@dataclass
class CfgGroups:
    """Worker groups for CFG-parallel: `half` runs one half of the batch, `pair` joins the halves."""

    half: ParallelGroup
    pair: ParallelGroup
    index: int  # 0: first half of the batch (unconditional), 1: second


def make_cfg_groups(pg: ParallelGroup, members: list[int] | None = None) -> CfgGroups | None:
    """Split `members` (global ranks; default: the whole world) into two equal halves.

    `torch.distributed.new_group` is collective over the world, so every process calls
    this, members or not; non-members get None.
    """
    import torch.distributed as dist

    members = list(range(dist.get_world_size())) if members is None else list(members)
    N = len(members)
    if N % 2:
        raise ValueError(f"cfg_parallel needs an even number of workers, got {N}")
    halves = [members[: N // 2], members[N // 2:]]
    pairs = [[members[i], members[i + N // 2]] for i in range(N // 2)]
    half_groups = [dist.new_group(r) for r in halves]
    pair_groups = [dist.new_group(p) for p in pairs]
    me = dist.get_rank()
    if me not in members:
        return None
    index = members.index(me) // (N // 2)
    mine = members.index(me) % (N // 2)
    return CfgGroups(
        half=pg.subgroup(halves[index], half_groups[index]),
        pair=pg.subgroup(pairs[mine], pair_groups[mine]),
        index=index,
    )


def cfg_parallel(forward, cfg: CfgGroups, *args, **kwargs) -> torch.Tensor:
    """Classifier-free guidance's two halves of a batch on the two halves of the workers.

    `args[0]` carries the batch, B rows (unconditional, then conditional). Every tensor argument whose first
    dimension is a multiple k B of it (k entries per row, e.g. FLF2V's two images; dict values included) is
    cut to this half's rows; `forward` runs them on this half's workers; the pair all-gather joins the halves:
    (B, ...) -> forward's (B/2, ...) -> (B, ...) on every rank (a tuple of outputs: each).
    """
    B = args[0].shape[0]
    if B % 2:
        raise ValueError(f"cfg_parallel needs an even batch (unconditional + conditional), got {B}")

    def half(v):
        if isinstance(v, dict):
            return {k: half(x) for k, x in v.items()}
        if torch.is_tensor(v) and v.ndim and v.shape[0] >= B and v.shape[0] % B == 0:
            return v.chunk(2)[cfg.index]
        return v

    out = forward(*(half(a) for a in args), **{k: half(v) for k, v in kwargs.items()})   # (B/2, ...)
    if isinstance(out, tuple):        # a model of several outputs (LTX-2: video, audio): each joined
        return tuple(comm.all_gather(o, 0, cfg.pair) for o in out)                         # (B, ...) each
    return comm.all_gather(out, 0, cfg.pair)                                               # (B, ...)


@dataclass
class SequenceParallel:
    """One rank's view of a sequence-parallel group: the whole group, and for USP its two sub-groups.

    ulysses: the k consecutive ranks that trade sequence for heads (the whole group for
    "ulysses", this rank alone for "ring"); ring: the ranks at the same position of every
    Ulysses group (this rank alone for "ulysses", the whole group for "ring").
    """

    pg: ParallelGroup
    name: str                   # "ulysses" | "ring" | "usp"
    ulysses: ParallelGroup
    ring: ParallelGroup
    #: diffusers' dispatcher backend of the local attention (None: PyTorch SDPA; engine/attention.py)
    attention_backend: str | None = None

    @property
    def world_size(self) -> int:
        return self.pg.world_size


def _solo(pg: ParallelGroup) -> ParallelGroup:
    return ParallelGroup(rank=0, world_size=1, device=pg.device, group=None)


def make_sequence_parallel(pg: ParallelGroup, name: str, ulysses_degree: int | None = None,
                           members: list[int] | None = None,
                           attention_backend: str | None = None) -> SequenceParallel | None:
    """`_make_sequence_parallel`, whose local attention runs `attention_backend` (None: PyTorch SDPA)."""
    sp = _make_sequence_parallel(pg, name, ulysses_degree, members)
    if sp is not None:
        sp.attention_backend = attention_backend
    return sp


def _make_sequence_parallel(pg: ParallelGroup, name: str, ulysses_degree: int | None = None,
                            members: list[int] | None = None) -> SequenceParallel | None:
    """Build the groups of `name` over `pg` (global ranks `members`; default: all of the world).

    Collective over the whole world (`new_group` is): every process calls it with the same
    arguments; processes outside `members` get None.
    """
    import torch.distributed as dist

    if name == "ulysses":
        return SequenceParallel(pg, name, ulysses=pg, ring=_solo(pg)) if pg is not None else None
    if name == "ring":
        return SequenceParallel(pg, name, ulysses=_solo(pg), ring=pg) if pg is not None else None
    if name != "usp":
        raise ValueError(f"no sequence-parallel groups for plan {name!r}")
    members = list(range(dist.get_world_size())) if members is None else list(members)
    N, k = len(members), ulysses_degree
    if not k or N % k:
        raise ValueError(f"ulysses_degree must divide the group size {N}; got {k!r}")
    ulysses_sets = [members[g * k:(g + 1) * k] for g in range(N // k)]
    ring_sets = [members[u::k] for u in range(k)]
    ulysses_groups = [dist.new_group(s) for s in ulysses_sets]
    ring_groups = [dist.new_group(s) for s in ring_sets]
    me = dist.get_rank()
    if me not in members or pg is None:
        return None
    pos = members.index(me)
    g, u = pos // k, pos % k
    return SequenceParallel(pg, name, ulysses=pg.subgroup(ulysses_sets[g], ulysses_groups[g]),
                            ring=pg.subgroup(ring_sets[u], ring_groups[u]))


# -- attention over a sharded sequence --------------------------------------------------------


@dataclass(frozen=True)
class BlockCausal:
    """Diffusion forcing's frame mask: a token of frame f sees the keys of frames in blocks <= f's block.

    Tokens are ordered frame-major (`frame_tokens` tokens per frame), blocks are
    `frames_per_block` consecutive frames.
    """

    frame_tokens: int
    frames_per_block: int

    def block_of(self, positions: torch.Tensor) -> torch.Tensor:
        return positions // (self.frame_tokens * self.frames_per_block)

    def visible(self, q_start: int, q_len: int, k_start: int, k_len: int, device) -> torch.Tensor | bool:
        """(q_len, k_len) bool (True = attend), or True when every key is visible, False when none is."""
        span = self.frame_tokens * self.frames_per_block
        if (k_start + k_len - 1) // span <= q_start // span:
            return True                                   # every key's block <= the first query's block
        if k_start // span > (q_start + q_len - 1) // span:
            return False                                  # every key is after the last query's block
        q = self.block_of(torch.arange(q_start, q_start + q_len, device=device))
        k = self.block_of(torch.arange(k_start, k_start + k_len, device=device))
        return k[None, :] <= q[:, None]


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                    q_start: int = 0, causal: BlockCausal | None = None, backend: str | None = None) -> torch.Tensor:
    """SDPA of queries at global positions [q_start, q_start + Lq) against keys at [0, Lk).

    q: (B, H, Lq, hd), k/v: (B, H, Lk, hd) -> (B, H, Lq, hd). With a block-causal mask the
    queries go block by block, each against the prefix of keys it may see (no Lq x Lk mask).
    `backend`: diffusers' dispatcher backend that runs it (None: PyTorch SDPA; engine/attention.py).
    """
    if causal is None:
        return attend(q, k, v, scale, backend)
    if not isinstance(causal, BlockCausal):   # another mask by global positions: its `visible` rows (RadialMask)
        from longserve.engine.attention import RadialMask, radial_attention

        Lq, Lk = q.shape[2], k.shape[2]
        if isinstance(causal, RadialMask) and q_start == 0 and Lq == Lk == causal.tokens and backend is None:
            return radial_attention(q, k, v, causal, scale)                    # block-sparse on CUDA
        return attend(q, k, v, scale, backend, attn_mask=causal.visible(q_start, Lq, 0, Lk, q.device))
    span = causal.frame_tokens * causal.frames_per_block
    outs = []
    Lq, Lk = q.shape[2], k.shape[2]
    start = 0
    while start < Lq:
        block = (q_start + start) // span
        stop = min(Lq, (block + 1) * span - q_start)
        keys = min(Lk, (block + 1) * span)
        outs.append(attend(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys], scale, backend))
        start = stop
    return torch.cat(outs, dim=2)


def ring_attention(q: torch.Tensor, kv: torch.Tensor, scale: float, pg: ParallelGroup, key_len: int,
                   q_start: int | None = None, causal: BlockCausal | None = None,
                   extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Exact softmax attention of local queries against keys sharded over the ring.

    q: (n, H, Lq, hd); kv: (2, n, H, Lk_local, hd), this rank's padded block of `key_len`
    keys (rank j holds keys [j*Lk_local, (j+1)*Lk_local)). Each of the N-1 steps sends the
    K/V block on in one message. Keys past `key_len` (padding on the last ranks) are
    masked; with `causal`, keys the block-causal mask hides are masked too (a block hidden
    entirely is skipped, but still passed on). `q_start`: the global position of the first
    query (default: this rank's block start). `extra`: (k, v, key_mask), keys that every rank
    holds whole and every query sees besides the ring's (k, v (n, H, Le, hd), key_mask (n, Le)
    bool, True = a real key), attended once, before the ring's (HunyuanVideo-1.5's condition
    tokens). Returns (n, H, Lq, hd) in float32.
    """
    n, H, Lq, hd = q.shape
    Lk = kv.shape[3]
    q_start = pg.rank * Lk if q_start is None else q_start
    m = torch.full((n, H, Lq, 1), float("-inf"), dtype=torch.float32, device=q.device)  # running max
    l = torch.zeros_like(m)                                                             # running sum
    acc = torch.zeros((n, H, Lq, kv.shape[-1]), dtype=torch.float32, device=q.device)

    def absorb(s: torch.Tensor, v: torch.Tensor) -> None:
        """Fold one block's scores s (n, H, Lq, Lk) and values v (n, H, Lk, hd) into the running softmax."""
        nonlocal m, l, acc
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)      # rows with nothing seen yet
        p = torch.exp(s - m_safe)
        correction = torch.exp(m - m_safe)
        l = l * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(p, v)
        m = m_new

    if extra is not None:
        k, v, key_mask = extra
        s = torch.matmul(q, k.float().transpose(-1, -2)) * scale                        # (n, H, Lq, Le)
        absorb(s.masked_fill(~key_mask[:, None, None, :], float("-inf")), v.float())
    for step in range(pg.world_size):
        src = (pg.rank - step) % pg.world_size                        # whose keys we hold now
        valid = min(Lk, key_len - src * Lk)
        seen = True if causal is None or valid <= 0 else causal.visible(q_start, Lq, src * Lk, valid, q.device)
        if valid > 0 and seen is not False:
            k, v = kv[0].float(), kv[1].float()
            s = torch.matmul(q, k.transpose(-1, -2)) * scale              # (n, H, Lq, Lk)
            if valid < Lk:
                s[..., valid:] = float("-inf")
            if seen is not True:
                s[..., :valid] = s[..., :valid].masked_fill(~seen, float("-inf"))
            absorb(s, v)
        if step < pg.world_size - 1:
            kv = comm.ring_shift(kv, pg)
    return acc / l


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SequenceParallel,
                                seq_len: int, scale: float | None = None,
                                causal: BlockCausal | None = None) -> torch.Tensor:
    """Exact attention over a sequence sharded across `sp`, for this rank's tokens.

    q, k, v: (B, Sl, H, hd), this rank's padded shard of `seq_len` tokens -> (B, Sl, H, hd).
    """
    B, Sl, H, hd = q.shape
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    u, r = sp.ulysses, sp.ring
    if u.world_size > 1:
        # sequence -> heads: gather the k shards of this Ulysses group, keep H/k heads
        qkv = torch.stack([q, k, v])                                              # (3, B, Sl, H, hd)
        qkv = comm.all_to_all_switch(qkv, scatter_dim=3, gather_dim=2, gather_size=u.world_size * Sl, pg=u)
        q, k, v = qkv.unbind(0)                                                   # (B, k*Sl, Hl, hd)
    chunk = q.shape[1]                                     # tokens this rank attends for: [start, start+chunk)
    start = r.rank * chunk
    if r.world_size == 1:
        keys = min(chunk, seq_len)                         # drop the padding before attending
        out = local_attention(q[:, :keys].transpose(1, 2), k[:, :keys].transpose(1, 2),
                              v[:, :keys].transpose(1, 2), scale, q_start=start, causal=causal,
                              backend=sp.attention_backend)                                 # (B, Hl, keys, hd)
        out = comm.pad_dim(out.transpose(1, 2), 1, chunk)                        # (B, chunk, Hl, hd)
    else:
        if sp.attention_backend not in (None, "native"):      # refused at start (engine/attention.py)
            raise ValueError(f"attention_backend={sp.attention_backend!r} cannot run in Ring attention")
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)])                  # (2, B, Hl, chunk, hd)
        out = ring_attention(q.transpose(1, 2).float(), kv, scale, r, key_len=seq_len, q_start=start,
                             causal=causal)                                       # (B, Hl, chunk, hd) fp32
        out = out.to(q.dtype).transpose(1, 2)                                     # (B, chunk, Hl, hd)
    if u.world_size > 1:
        # heads -> sequence: give every rank of the group its own tokens back, with all heads
        out = comm.all_to_all_switch(out, scatter_dim=1, gather_dim=2, gather_size=H, pg=u)  # (B, Sl, H, hd)
    return out

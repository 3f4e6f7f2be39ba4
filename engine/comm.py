"""Collectives over a `ParallelGroup`, each one documented by its input and output shapes.

Every function that talks to other workers records, in this process's `STATS`, the
bytes this rank sends under the standard algorithm for that collective and one call of
its kind. That makes the communication of any run reportable exactly, independent of
the backend (gloo, NCCL) and of what the backend does internally:

    all-to-all      sends (N-1)/N of its input (it keeps its own chunk)
    all-gather      sends its chunk to the N-1 others: (N-1) x chunk
    reduce-scatter  ring algorithm: (N-1)/N of its (full-size) input
    all-reduce      ring algorithm: 2 (N-1)/N of its input
    send (ring)     the whole tensor once
    send (to one)   the whole tensor once (a pipeline stage's activations: `send_to` / `recv_from`)
    gather to dst   every rank but dst sends its input once; dst sends nothing

Uneven sizes: a dimension that does not divide by N is zero-padded up to the next
multiple of N before it is sharded and trimmed back after it is gathered, so callers
never have to reject a size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longserve.engine.dist import ParallelGroup


@dataclass
class CommStats:
    bytes_sent: int = 0
    calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, nbytes: float) -> None:
        self.bytes_sent += int(round(nbytes))
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes_sent = 0
        self.calls = Counter()

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "calls": dict(self.calls)}


STATS = CommStats()

#: Collectives this process has entered, ever (control broadcasts included, unlike STATS). The worker
#: pool compares it before and after a failed job: a job that failed before entering any collective
#: left nothing pending on the other ranks, so the group is still in step without a restart.
ISSUED = [0]


def _issue() -> None:
    ISSUED[0] += 1

# Newer torch names the tensor collectives `*_single` and deprecates the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def shard_size(size: int, world_size: int) -> int:
    """Length of each (padded) shard of a dimension of `size` split `world_size` ways."""
    return math.ceil(size / world_size)


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad dimension `dim` of `x` up to `size` (no-op if already that long)."""
    dim = dim % x.ndim
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of size {x.shape[dim]} down to {size}")
    pad = [0, 0] * (x.ndim - dim - 1) + [0, extra]
    return F.pad(x, pad)


def local_range(size: int, pg: ParallelGroup) -> tuple[int, int]:
    """[start, stop) of this rank's rows of a dimension of `size`, before trimming the pad."""
    n = shard_size(size, pg.world_size)
    return pg.rank * n, (pg.rank + 1) * n


def valid_length(size: int, pg: ParallelGroup) -> int:
    """How many of this rank's shard rows are real (not padding) for a dimension of `size`."""
    start, stop = local_range(size, pg)
    return max(0, min(stop, size) - start)


def shard(x: torch.Tensor, dim: int, pg: ParallelGroup) -> torch.Tensor:
    """Take this rank's slice of `dim` (every rank holds the full tensor; no communication).

    [..., L, ...] -> [..., ceil(L/N), ...]   (zero-padded on the last ranks)
    """
    if pg.world_size == 1:
        return x
    n = shard_size(x.shape[dim], pg.world_size)
    x = pad_dim(x, dim, n * pg.world_size)
    return x.narrow(dim, pg.rank * n, n)


def all_gather(x: torch.Tensor, dim: int, pg: ParallelGroup, size: int | None = None) -> torch.Tensor:
    """Concatenate every rank's equal-sized shard along `dim`, then trim to `size`.

    [..., l, ...] -> [..., size or N*l, ...]
    """
    if pg.world_size == 1:
        return x if size is None else x.narrow(dim, 0, size)
    _issue()
    dim = dim % x.ndim
    chunk = x.movedim(dim, 0).contiguous()  # (l, ...)
    out = torch.empty((pg.world_size * chunk.shape[0], *chunk.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_tensor(out, chunk, group=pg.group)  # (N*l, ...)
    STATS.record("all_gather", (pg.world_size - 1) * _nbytes(chunk))
    out = out.movedim(0, dim)
    return out if size is None else out.narrow(dim, 0, size)


def gather(x: torch.Tensor, dim: int, size: int, pg: ParallelGroup) -> torch.Tensor:
    """Inverse of `shard`: all-gather the shards of `dim` and trim the padding.

    [..., ceil(size/N), ...] -> [..., size, ...]
    """
    return all_gather(x, dim, pg, size=size)


def all_to_all_switch(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, gather_size: int, pg: ParallelGroup
) -> torch.Tensor:
    """Switch which dimension is sharded, with one all-to-all.

    Input: full `scatter_dim` (length A), `gather_dim` sharded (this rank's padded shard of b).
    Output: `scatter_dim` sharded (padded to ceil(A/N)), `gather_dim` whole, trimmed to `gather_size`.

        [.., A, .., b, ..] -> [.., ceil(A/N), .., gather_size, ..]
    """
    if pg.world_size == 1:
        return x.narrow(gather_dim, 0, gather_size)
    _issue()
    N = pg.world_size
    scatter_dim, gather_dim = scatter_dim % x.ndim, gather_dim % x.ndim
    a = shard_size(x.shape[scatter_dim], N)
    x = pad_dim(x, scatter_dim, a * N)
    send = torch.stack(x.split(a, dim=scatter_dim), dim=0).contiguous()  # (N, .., a, .., b, ..)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg.group)  # recv[j]: rank j's shard of b, my slice of A
    STATS.record("all_to_all", _nbytes(send) * (N - 1) / N)
    out = torch.cat(recv.unbind(0), dim=gather_dim)  # (.., a, .., N*b, ..)
    return out.narrow(gather_dim, 0, gather_size)


def reduce_scatter(x: torch.Tensor, dim: int, pg: ParallelGroup) -> torch.Tensor:
    """Sum every rank's full-size partial `x` and keep this rank's shard of `dim`.

    [..., L, ...] -> [..., ceil(L/N), ...]   (L zero-padded to a multiple of N first)
    """
    if pg.world_size == 1:
        return x
    _issue()
    N = pg.world_size
    dim = dim % x.ndim
    n = shard_size(x.shape[dim], N)
    full = pad_dim(x, dim, n * N).movedim(dim, 0).contiguous()  # (N*n, ...)
    out = torch.empty((n, *full.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_tensor(out, full, group=pg.group)  # (n, ...)
    STATS.record("reduce_scatter", _nbytes(full) * (N - 1) / N)
    return out.movedim(0, dim)


def all_reduce(x: torch.Tensor, pg: ParallelGroup) -> torch.Tensor:
    """Elementwise sum over ranks (returns a new tensor; `x` is untouched)."""
    if pg.world_size == 1:
        return x
    _issue()
    out = x.clone()
    dist.all_reduce(out, group=pg.group)
    STATS.record("all_reduce", 2 * _nbytes(out) * (pg.world_size - 1) / pg.world_size)
    return out


def ring_shift(x: torch.Tensor, pg: ParallelGroup) -> torch.Tensor:
    """Send `x` to rank+1 and receive rank-1's tensor of the same shape (one ring step)."""
    if pg.world_size == 1:
        return x
    _issue()
    x = x.contiguous()
    recv = torch.empty_like(x)
    nxt = pg.global_rank((pg.rank + 1) % pg.world_size)
    prv = pg.global_rank((pg.rank - 1) % pg.world_size)
    ops = [
        dist.P2POp(dist.isend, x, nxt, group=pg.group),
        dist.P2POp(dist.irecv, recv, prv, group=pg.group),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    STATS.record("send_recv", _nbytes(x))
    return recv


def broadcast_object(obj, pg: ParallelGroup, src: int = 0):
    """Rank `src`'s Python object on every rank (control data, not accounted as activations)."""
    if pg.world_size == 1:
        return obj
    _issue()
    box = [obj]
    dist.broadcast_object_list(box, src=pg.global_rank(src), group=pg.group)
    return box[0]


def gather_to(x: torch.Tensor, dst: int, pg: ParallelGroup) -> torch.Tensor | None:
    """Stack every rank's equal-shaped `x` on rank `dst` (a group rank) only.

    [...] -> [N, ...] on `dst` (row r is rank r's `x`); None on every other rank.
    """
    if pg.world_size == 1:
        return x.unsqueeze(0)
    _issue()
    x = x.contiguous()
    if pg.rank != dst:
        dist.gather(x, gather_list=None, group=pg.group, group_dst=dst)
        STATS.record("gather", _nbytes(x))
        return None
    out = torch.empty((pg.world_size, *x.shape), dtype=x.dtype, device=x.device)  # (N, ...)
    dist.gather(x, gather_list=list(out.unbind(0)), group=pg.group, group_dst=dst)
    STATS.record("gather", 0)  # dst keeps its own row
    return out


def send_to(x: torch.Tensor, dst: int, pg: ParallelGroup, tag: int = 0):
    """Start sending `x` to rank `dst` (a group rank) without waiting: [...] -> the send's handle, to `wait()` on
    before `x` is written again. A receiver takes it with `recv_from` of the same shape, dtype and tag."""
    _issue()
    x = x.contiguous()
    work = dist.isend(x, dst=pg.global_rank(dst), group=pg.group, tag=tag)
    STATS.record("send", _nbytes(x))
    return work, x                    # the tensor stays referenced until the send is waited for


def recv_from(shape: tuple, dtype: torch.dtype, src: int, pg: ParallelGroup, tag: int = 0) -> torch.Tensor:
    """The tensor rank `src` sent with `send_to`: -> [shape] (waits for it)."""
    _issue()
    out = torch.empty(shape, dtype=dtype, device=pg.device)
    dist.recv(out, src=pg.global_rank(src), group=pg.group, tag=tag)
    return out

"""The worker side of an overlapped or pipelined live loop (engine/live_lane.py says what the loops are).

One job, `engine.worker.live_tick`, carries a step boundary's decode *and* its denoising steps: every rank takes the
decoded chunk's place in its frame stream at once (the stream's bookkeeping, identical everywhere), the lane rank
hands the decode itself to its `DecodeLane`, the denoising ranks run the steps meanwhile, and the lane's frames are
waited for only at the job's end. The coordinator reads the chunk and the steps' progress from one result.

Roles, by `LoopRoles` (the causal family builds them in `set_plan`):

    serial       no lane: `live_tick` decodes, then steps, as two jobs would
    overlapped   lane = rank 0 (its decode on a single-rank VAE path: no collective beside the steps')
    pipelined    lane = rank N-1, which runs no transformer; the chunk's final latents go to it from rank 0 (one
                 point-to-point message at the tick's start, with the frame limit a stop may have lowered)
    stages       lane = rank 0, as overlapped: every rank runs a stage of the transformer's blocks
                 (engine/live_stages.py) while rank 0's lane decodes the last group's chunks, one per job
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from longserve.engine.dist import ParallelGroup


@dataclass(frozen=True)
class LoopRoles:
    """Who does what in a worker's live loop."""

    loop: str                          # "serial" | "overlapped" | "pipelined" | "stages"
    lane: int | None                   # the rank that decodes (None: serial, the VAE path's own split)
    denoisers: tuple[int, ...]         # the ranks that run the transformer

    @property
    def transfer(self) -> bool:
        """The lane is not a denoiser: final latents must be sent to it."""
        return self.lane is not None and self.lane not in self.denoisers


def loop_roles(loop: str, world_size: int) -> LoopRoles:
    """The roles of `loop` over `world_size` workers (pipelined on one worker is the overlapped loop)."""
    ranks = tuple(range(world_size))
    if loop == "serial":
        return LoopRoles("serial", None, ranks)
    if loop == "stages":                       # every rank a stage of the blocks; rank 0's lane decodes beside them
        return LoopRoles("stages", 0, ranks)
    if loop == "pipelined" and world_size > 1:
        return LoopRoles("pipelined", world_size - 1, ranks[:-1])
    return LoopRoles("overlapped", 0, ranks)


def solo_group(pg: ParallelGroup) -> ParallelGroup:
    """A single-rank view of this worker (the lane's VAE path: nothing to split, no collective)."""
    return ParallelGroup(rank=0, world_size=1, device=pg.device)


@dataclass
class PendingDecode:
    """A tick's decode, taken from the request's stream (`start`: its first frame), running or made on the lane
    rank."""

    request: object
    start: int
    future: object = None              # on the lane rank: (frames, seconds) when done; None elsewhere


def begin_decode(family, ctx, req, max_frames: int) -> PendingDecode:
    """Take `req`'s next chunk from its stream on every rank; on the lane rank, start decoding it on the lane thread
    (beside this rank's steps), or decode it now (a decode worker, which runs no steps)."""
    roles, rank = family.roles, ctx.pg.rank
    if roles.transfer and rank in (0, roles.lane):
        t0 = time.perf_counter()
        _hand_over(req, rank, roles.lane, ctx.pg.device)
        req.timings["transfer_s"] = req.timings.get("transfer_s", 0.0) + time.perf_counter() - t0
    start = req.decoded_frames
    run = req.frames.take(max_frames)
    req.decoded_frames = req.frames.frames_out
    pending = PendingDecode(req, start)
    if rank == roles.lane:
        def decode():
            t0 = time.perf_counter()           # the lane's own time, from when it takes the chunk up
            return run(), time.perf_counter() - t0

        if rank in roles.denoisers:            # the steps run on this rank's main thread meanwhile
            pending.future = family.lane.submit(decode)
        else:                                  # a decode worker: nothing else runs here, so its main thread
            pending.future = Future()
            pending.future.set_result(decode())
    return pending


def finish_decode(pending: PendingDecode):
    """The lane rank's frames and the decode's seconds (the job waits here); (None, 0) elsewhere."""
    if pending.future is None:
        return None, 0.0
    frames, vae_s = pending.future.result()
    pending.request.timings["vae_s"] = pending.request.timings.get("vae_s", 0.0) + vae_s
    return frames, vae_s


def _hand_over(req, rank: int, lane: int, device) -> None:
    """Rank 0 sends the chunk it made (its stream's first piece, and the frame limit) to the lane rank, which
    pushes it into its own stream: the two streams then take the same piece."""
    import torch.distributed as dist

    from longserve.engine import comm

    comm._issue()                                    # noqa: SLF001 - a collective-like exchange: the pool's model
    if rank == 0:
        latents, info = req.frames.pieces[0]
        box = [(latents.cpu(), info, req.frames.limit, req.frames.complete)]
        dist.send_object_list(box, dst=lane)
    else:
        box = [None]
        dist.recv_object_list(box, src=0)
        latents, info, limit, complete = box[0]
        req.frames.limit = limit
        req.frames.push(latents.to(device), info, last=complete)
        req.num_frames = min(req.num_frames, limit)


def lane_request(family, spec, request_cls):
    """The pipelined loop's decode rank holds a request's frame stream alone: its chunks come from rank 0."""
    from longserve.engine.decoding import FramesPolicy

    cfg = family.cfg
    latent_frames = (spec.num_frames - 1) // family.vae_temporal + 1
    lead = int(spec.options.get("image") is not None)
    num_chunks = -(-(latent_frames - lead) // cfg.frames_per_block)
    frames = family.frame_stream(spec, spec.num_frames, FramesPolicy(family.vae_temporal, whole=True))
    frames.rank = 0                   # it hands the frames (or latents) out, as rank 0 does in the serial loop
    return request_cls(spec=spec, num_steps=num_chunks * cfg.steps_per_chunk - 1, batch_key=("causal", "lane"),
                       num_frames=spec.num_frames, cfg=cfg, num_chunks=num_chunks, latent_frames=latent_frames,
                       lead=lead, frames=frames)


def lane_threads() -> int:
    """The lane's intra-op threads on the CPU: the worker's own budget (the pool's `threads`)."""
    return max(1, torch.get_num_threads())

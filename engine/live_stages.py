"""The stages live loop (`--live-loop stages`): a causal model's transformer blocks split into one stage per worker,
and a stream batch of chunks in flight through them at different denoising steps (StreamDiffusionV2's pipeline-
parallel stream batch).

Stages: rank r of N runs the blocks `stage_blocks(L, N)[r]` (contiguous; when L does not divide by N the earlier
ranks take one block more); rank 0 also runs the embeddings (patch, time, text), the last rank the output norm and
projection. A rank keeps the KV cache of its own blocks only (`KVCache(first_layer=...)`): about 1/N of a video's
cache per worker. The weights are loaded whole on every rank, as the other loops load them; a stage runs its own.

Work items are forwards of a *group* of G <= B consecutive chunks k..k+G-1 (B: `--stream-batch`, default N): the
denoising steps f = 0..S-1 of each member m, then its context pass f = S, in the order

    (0,0) (1,0) .. (G-1,0) (0,1) .. (G-1,S-1)   (0,S) (1,S) .. (G-1,S)     item j = (m, f); j - G = (m, f - 1)

Item j's latents are item j-G's output through the scheduler step, so rank 0 starts item j once item j-G came
back; every stage runs its items in this order, as soon as the previous stage hands them over: with B >= N no stage
waits after the pipeline fills (lock-step ticks: stage i runs item t-i at tick t), with B < N the stream has bubbles.
A group ends at a prompt schedule's switch (a switch applies at a chunk's start) and at the video's end; the last
chunk takes no context pass (as in the serial loop).

What a member attends to, at each layer: the cache as it stood at the group's start, plus the K/V the group's
earlier members wrote at that layer *at the same denoising step* (one item earlier at this stage), plus itself:
the group is denoised as one chunk of G*fb frames with block-causal attention at one noise level, at its frames'
own positions (`KVCache.prepare(offset=m*fb)`; the chunk slots hold B chunks). The context passes run in chunk
order, each after its predecessors' are cached: the clean K/V a later group reads are the serial loop's, given the
same latents. Member 0 reads exactly what the serial loop's chunk k reads; with B = 1 every chunk is member 0 and
the loop makes the serial loop's numbers (tests/engine/test_live_stages.py); with B > 1 member m > 0 reads its
predecessors at its own noise level, not clean (docs/design.md "The stages live loop" measures the difference).

Messages, point to point (`comm.send_to` / `recv_from`; gloo and NCCL both have send/recv): rank r -> r+1 one float32
tensor per item, (B, S_tok + 7 [+ L], D) = [hidden states | time projection (6) | time embedding (1) | the text's
embedding, only when a row's cached text K/V are stale]; float32 carries bfloat16 and float16 values exactly. The last
rank sends every item's flow prediction (B, C, f, h, w) to every other rank, which apply the same scheduler steps in
the same order: a request's state stays identical on every rank, as in the other loops. The decode is the overlapped
loop's on rank 0 (`LoopRoles("stages", lane=0)`): a job decodes one chunk on rank 0's lane, and a group runs in the
job that takes its predecessor's last chunk, beside that decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from longserve.engine import comm
from longserve.engine.dist import ParallelGroup
from longserve.engine.models.causal import CausalShard, CausalWan, KVCache

ACTIVATIONS, PREDICTIONS = 1, 2                 # message tags


def stage_blocks(layers: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous, the first `layers % stages` stages one block more."""
    base, extra = divmod(layers, stages)
    if base == 0:
        raise ValueError(f"live_loop 'stages': {stages} workers for a transformer of {layers} blocks (a stage "
                         f"needs at least one block)")
    ranges, lo = [], 0
    for r in range(stages):
        hi = lo + base + (r < extra)
        ranges.append(range(lo, hi))
        lo = hi
    return ranges


@dataclass(frozen=True)
class Item:
    """One forward of the stream, as every rank knows it before it runs."""

    shape: tuple                # the latents' (B, C, f, h, w)
    timestep: torch.Tensor      # (B,)
    offset: int                 # frames between the cached ones and this chunk (a later member's denoising step)
    write: bool                 # a context pass: its K/V are cached
    text: torch.Tensor          # (B, L, C_text): the prompt's (rank 0 embeds it when a row's text K/V are stale)
    caches: tuple
    versions: tuple


class StagedCausal:
    """A `CausalWan` cut into pipeline stages over `pg` (this rank runs `blocks`); the family's model in the stages
    loop: `new_cache` and one forward through every stage (`__call__`, a recache's or a start image's), and
    `stream` for a group's items."""

    def __init__(self, causal: CausalWan, pg: ParallelGroup, sp, stream_batch: int):
        self.causal, self.model, self.pg, self.sp = causal, causal.model, pg, sp
        self.stream_batch = stream_batch
        self.blocks = stage_blocks(self.model.config.num_layers, pg.world_size)[pg.rank]
        self._dtypes = None

    # -- the family's model ------------------------------------------------------------------------

    def new_cache(self, h: int, w: int, sp, text_len: int) -> KVCache:
        """This stage's part of a video's cache: its blocks' layers, every head, B chunks' slots."""
        c = self.model.config
        p = self.model.patch_embedding.weight
        return KVCache(self.causal.cfg, len(self.blocks), self.causal.frame_tokens(h, w), c.num_attention_heads,
                       c.attention_head_dim, text_len, c.num_attention_heads, p.dtype, p.device,
                       chunks=self.stream_batch, first_layer=self.blocks.start)

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, sp, caches: list,
                 versions: list, write: list) -> torch.Tensor:
        """One forward through every stage (x known to every rank): the output (B, C, f, h, w) on every rank."""
        if len(set(write)) != 1:
            raise ValueError("a staged forward writes every row's cache or none")
        item = Item(tuple(x.shape), timestep, 0, write[0], text, tuple(caches), tuple(versions))
        out = []
        self.stream([item], lambda j: x, lambda j, pred: out.append(pred), lag=1)
        return out[0]

    # -- a stream of items ---------------------------------------------------------------------------

    def stream(self, items: list[Item], inputs, take, lag: int) -> None:
        """Run `items` through the stages, in order. Rank 0 makes item j's latents with `inputs(j)` once item
        j - lag's output was taken; every rank calls `take(j, output)` for every item in order (rank 0 as the
        outputs come back, the others after their last item)."""
        rank, last, pg = self.pg.rank, self.pg.world_size - 1, self.pg
        sends, outs, taken = [], {}, 0
        for j, item in enumerate(items):
            if rank == 0:
                while taken <= j - lag:                         # the item this one's latents come from
                    take(taken, self._recv_output(items[taken]))
                    taken += 1
                parts = self._embed(item, inputs(j))
            else:
                parts = self._unpack(item, comm.recv_from(self._message_shape(item), torch.float32, rank - 1, pg,
                                                          ACTIVATIONS))
            text = self._needs_text(item)                           # before the blocks cache the text's K/V
            hidden = self._run_blocks(item, *parts)
            if rank < last:
                sends.append(comm.send_to(self._pack(hidden, *parts[1:], text), rank + 1, pg, ACTIVATIONS))
            else:
                outs[j] = self._head(item, hidden, parts[2]).float()               # (B, C, f, h, w)
                sends += [comm.send_to(outs[j], dst, pg, PREDICTIONS) for dst in range(last)]
        for j in range(taken, len(items)):
            take(j, outs.pop(j) if rank == last else self._recv_output(items[j]))
        for work, _ in sends:
            work.wait()

    def _recv_output(self, item: Item) -> torch.Tensor:
        B, _, f, h, w = item.shape
        return comm.recv_from((B, self.model.config.out_channels, f, h, w), torch.float32, self.pg.world_size - 1,
                              self.pg, PREDICTIONS)

    def _needs_text(self, item: Item) -> bool:
        """Some row's cached text K/V are not its prompt's (the same answer on every rank: each rank's caches saw
        the same items)."""
        return any(c.text_version != v for c, v in zip(item.caches, item.versions))

    def _tokens(self, item: Item) -> int:
        _, _, f, h, w = item.shape
        p_t, p_h, p_w = self.model.config.patch_size
        return (f // p_t) * (h // p_h) * (w // p_w)

    def _message_shape(self, item: Item) -> tuple:
        text = item.text.shape[1] if self._needs_text(item) else 0
        return (item.shape[0], self._tokens(item) + 7 + text, self.model.config.num_attention_heads
                * self.model.config.attention_head_dim)

    def dtypes(self) -> tuple:
        """The dtypes of (hidden states, time projection, time embedding, text embedding) in this model: what the
        float32 messages are cast back to (found once, by running the embedder on a dummy)."""
        if self._dtypes is None:
            m = self.model
            dev = m.patch_embedding.weight.device
            with torch.no_grad():
                temb, proj, text, _ = m.condition_embedder(torch.zeros(1, device=dev), torch.zeros(
                    1, 1, m.config.text_dim, device=dev, dtype=m.patch_embedding.weight.dtype), None)
            self._dtypes = (m.patch_embedding.weight.dtype, proj.dtype, temb.dtype, text.dtype)
        return self._dtypes

    @staticmethod
    def _pack(hidden, proj, temb, text, with_text: bool) -> torch.Tensor:
        parts = [hidden.float(), proj.float(), temb.float()[:, None]]              # (B, S, D) (B, 6, D) (B, 1, D)
        if with_text:
            parts.append(text.float())                                            # (B, L, D)
        return torch.cat(parts, dim=1)

    def _unpack(self, item: Item, message: torch.Tensor) -> tuple:
        S = self._tokens(item)
        hd, pd, td, xd = self.dtypes()
        text = message[:, S + 7:].to(xd) if message.shape[1] > S + 7 else None
        return message[:, :S].to(hd), message[:, S:S + 6].to(pd), message[:, S + 6].to(td), text

    # -- the model's parts, as diffusers' WanTransformer3DModel.forward runs them ---------------------

    def _running(self, item: Item):
        shard = CausalShard.of(self.model, torch.empty(item.shape, device="meta"), self.sp, caches=item.caches,
                               versions=item.versions)
        return self.causal.sharded.running(shard)

    def _embed(self, item: Item, x: torch.Tensor) -> tuple:
        """Rank 0: patch, time and text embeddings -> (B, S, D), (B, 6, D), (B, D), (B, L, D)."""
        m = self.model
        with self._running(item):
            hidden = m.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()          # (B, S, D)
            temb, proj, text, _ = m.condition_embedder(item.timestep, item.text, None, timestep_seq_len=None)
        return hidden, proj.unflatten(1, (6, -1)), temb, text

    def _run_blocks(self, item: Item, hidden, proj, temb, text) -> torch.Tensor:
        """This stage's blocks over the item's rows, each row's cache prepared before and written after."""
        frames = item.shape[2]
        rotary = self.causal.rotary(*item.shape[3:])
        for c in item.caches:
            c.prepare(frames, rotary, item.offset)
            c.write = item.write
        if self.causal.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self._running(item):
            for i in self.blocks:
                hidden = self.model.blocks[i](hidden, text, proj, None)                     # (B, S, D)
        for c, v in zip(item.caches, item.versions):
            c.text_version = v
            if item.write:
                c.commit(frames)
            c.write = False
        return hidden

    def _head(self, item: Item, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The last stage: output norm, projection, unpatchify -> (B, C_out, f, h, w)."""
        m = self.model
        B, _, f, h, w = item.shape
        p_t, p_h, p_w = m.config.patch_size
        shift, scale = (m.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)   # (B, 1, D) each
        with self._running(item):
            hidden = (m.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
            hidden = m.proj_out(hidden)                                                 # (B, S, p*C_out)
        hidden = hidden.reshape(B, f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1)
        return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def check_stages(config, desc) -> None:
    """Refuse, before any worker loads, a stages loop that could not run (ValueError naming `live_loop`)."""
    layers = getattr(desc.facts, "layers", None)
    if not desc.capabilities.live or layers is None:
        raise ValueError(f"live_loop 'stages' splits a causal (live) model's blocks across the workers; "
                         f"{config.model!r} is a {desc.family} model")
    if config.cuda_graphs:
        raise ValueError("cuda_graphs=True is not built for live_loop 'stages' (a stage's inputs arrive in new "
                         "buffers from the previous stage, which replayed graphs would copy in every time)")
    stage_blocks(layers, config.workers)


def stage_cache(layers: int, heads: int, config) -> tuple[int, int, int]:
    """(layers, heads, chunks) of a video's cache on the worker that holds the most of it."""
    return -(-layers // config.workers), heads, config.stream_batch or config.workers


def stage_plan(family, plan) -> None:
    """The causal family's groups and model in the stages loop (collective, as `set_plan` is): no sequence
    parallelism (a rank alone runs its blocks over the whole chunk), the model cut into stages."""
    from longserve.engine.live_loop import solo_group
    from longserve.engine.parallel import make_sequence_parallel

    family.tpg, family.cfg_groups, family.sp_cfg, family.plan = family.pg, None, None, plan
    family.sp = make_sequence_parallel(solo_group(family.pg), "ulysses")
    batch = family.config.engine.stream_batch or family.pg.world_size
    family.model = StagedCausal(family.model, family.pg, family.sp, batch)


def step_groups(family, reqs: list) -> None:
    """The stages loop's `step`: each request's next group, once its last group's chunks are all taken for decoding
    (one chunk a job, on rank 0's lane beside these steps: so the chunks waiting for it stay at most one group's)."""
    for r in reqs:
        if not r.denoised and not r.decodable():
            step_group(family, r)


def group_size(r, stream_batch: int) -> int:
    """Chunks in `r`'s next group: the stream batch, cut at the video's end and at a scheduled prompt switch."""
    switch = min((c for c in r.schedule if c > r.chunk), default=r.num_chunks)
    return max(1, min(stream_batch, r.num_chunks - r.chunk, switch - r.chunk))


def step_group(family, r) -> None:
    """Every forward of `r`'s next group of chunks through the stages, with their scheduler steps (every rank).
    The request starts and ends it at a chunk's start (phase 0); its chunks' final latents go to its frame stream in
    order, and the next group's first chunk is started (a pending prompt switch applies there)."""
    t0 = time.perf_counter()
    cfg, staged = family.cfg, family.model
    S, fb, B = len(cfg.timesteps), cfg.frames_per_block, r.spec.batch_size
    k, G = r.chunk, group_size(r, staged.stream_batch)
    shape = tuple(r.x.shape)                                                    # (B, C, fb, h, w)
    noises = [r.noise] + [family._chunk_noise(r, shape) for _ in range(G - 1)]  # in chunk order, as serial draws
    xs, x0s = [n[0] for n in noises], [None] * G
    first = r.caches[0].frames_written                                          # member m's frames: first + m*fb..
    order = [(m, f) for f in range(S) for m in range(G)]
    order += [(m, S) for m in range(G - (k + G >= r.num_chunks))]               # the video's last chunk: none
    text = r.texts[r.prompt_index].expand(B, -1, -1)
    versions = (r.prompt_index,) * B

    def item(m: int, f: int) -> Item:
        t = cfg.context_noise if f == S else cfg.timesteps[f]
        return Item(shape, torch.full((B,), t, device=family.pg.device), 0 if f == S else m * fb, f == S, text,
                    tuple(r.caches), versions)

    def inputs(j: int) -> torch.Tensor:
        m, f = order[j]
        return (x0s[m] if f == S else xs[m]).to(family.dtype)

    def take(j: int, pred: torch.Tensor) -> None:
        m, f = order[j]
        r.steps_done += 1
        if f == S:                             # the context pass cached the chunk: keep its clean latents
            for i in range(fb):
                r.clean[:, :, r.caches[0].slot_of(first + m * fb + i)] = x0s[m][:, :, i]
            return
        x0 = xs[m] - cfg.sigma(cfg.timesteps[f]) * pred
        if f < S - 1:
            s = cfg.sigma(cfg.timesteps[f + 1])
            xs[m] = (1 - s) * x0 + s * noises[m][f + 1]
        else:
            x0s[m] = x0
            family.push_final(r, k + m, x0)

    with torch.no_grad():
        staged.stream([item(m, f) for m, f in order], inputs, take, lag=G)
    r.chunk, r.x0 = k + G, None
    if r.denoised:
        r.x = r.noise = None
        r.batch_key = ("causal", "done")
    else:
        family._start_chunk(r)
    family._timed_sync()
    r.timings["transformer_s"] += time.perf_counter() - t0


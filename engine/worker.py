"""The video engine's jobs on the workers: whatever the model, the same five.

A request lives on the workers from `admit` to `release`. Every worker holds an identical
copy of its state (latents, the diffusers scheduler, the prompt embeddings), so after each
parallel forward, whose output every rank receives, all ranks take the same scheduler step
and stay in lockstep. The model family (`engine/families/`) found from the checkpoint's
`model_index.json` does the model-specific work:

- `admit(spec)`: the prompt is encoded once, on rank 0 (the only rank that loads the text
  encoder), broadcast, and latents and a scheduler are prepared;
- `step(ids, max_steps)`: denoising steps for a batch of requests with the same batch key
  (they may be at different timesteps, guidance scales and prompt lengths);
- `decode_next(id, max_frames)`: the next final frames are VAE-decoded, split across the
  workers, and handed to rank 0 (for a long video, while later segments still denoise);
- `update(id, payload)`: a running request changes course (a live session's new prompt, or stop);
- `live_tick(ids, max_steps, id, max_frames)`: a live loop's decode and the steps beside it, in one job
  (engine/live_loop.py: the decode on a lane while the steps run);
- `release(ids)`: the state is dropped.

The coordinator (`engine.core.EngineCore`, deciding with `engine.scheduler.Scheduler`)
picks which requests each job runs; it never touches the model. Results are the small
dataclasses of `engine.results` (they cross the pool's result queue).
"""

from __future__ import annotations

import time

from longserve.engine.config import WorkerConfig
from longserve.engine.families import detect_family
from longserve.engine.parallel import ParallelPlan
from longserve.engine.request import GenerationSpec
from longserve.engine.results import Admission, AdmitFailure, DecodedChunk, EncodeRefused, LiveTick, StepResult


def setup_worker(ctx, config: WorkerConfig) -> None:
    """Load the checkpoint's family on this worker (the text encoder on rank 0 only)."""
    family = detect_family(config.model_dir)
    backend = config.engine.attention_backend
    if backend is not None and family.dispatcher_attention and ctx.pg.device.type != "cpu":
        from longserve.engine.attention import head_dims, probe  # the coordinator probed a CPU engine; this GPU's
        from longserve.engine.dist import parse_dtype

        probe(backend, ctx.pg.device, parse_dtype(config.engine.dtype), masked=family.attention_masks,
              dims=head_dims(config.model_dir))
    ctx.state["family"] = loaded = family(ctx, config)
    ctx.state["requests"] = {}
    ctx.state["compile_s"] = None
    if config.engine.compile != "none":       # compile now, at the default size, rather than in the first request
        ctx.state["compile_s"] = loaded.warm_up()


def model_info(ctx) -> dict:
    """What the workers report about the loaded model (rank 0's view)."""
    from longserve.engine.compile import compiled_graphs

    family = ctx.state["family"]
    engine = family.config.engine
    return {"plan": family.plan, "device": str(ctx.pg.device), "dtype": str(family.dtype).replace("torch.", ""),
            "workers": ctx.pg.world_size, "attention": family.attention,
            "attention_backend": engine.attention_backend if family.dispatcher_attention else None,
            "scheduler": type(family.pipe.scheduler).__name__, "vae_tiling": family.vae_tiling,
            "compile": engine.compile, "compile_s": ctx.state.get("compile_s"), "compiled_graphs": compiled_graphs(),
            "quantize": engine.quantize}


def set_plan(ctx, plan: ParallelPlan) -> None:
    """Switch the parallel plan of a running pool (weights stay loaded)."""
    ctx.state["family"].set_plan(plan)


def admit(ctx, spec: GenerationSpec) -> Admission | AdmitFailure:
    """Encode the prompt (rank 0), share it, prepare latents and a scheduler for one request.

    When rank 0 could not encode the request's inputs, every rank knows it after the one broadcast
    (`EncodeRefused`): the job returns the request's `AdmitFailure` on every rank, and no rank holds its state, so
    the request fails alone and the pool stays up."""
    try:
        req = ctx.state["family"].admit(spec)
    except EncodeRefused as e:
        return AdmitFailure(str(e), e.field)
    ctx.state["requests"][spec.request_id] = req
    return Admission(req.num_steps, req.num_frames, req.timings["encode_s"], req.progress())


def step(ctx, request_ids: list[str], max_steps: int = 1) -> StepResult:
    """Denoising steps for the listed requests, each step one batched parallel forward.

    Runs up to `max_steps` steps, and stops after the step at which anything the scheduler
    must see happens: a request finishes denoising, has final frames to decode (a long
    video's segment ended), or the batch's key changes (another expert, another interval).
    """
    reqs = [ctx.state["requests"][rid] for rid in request_ids]
    family = ctx.state["family"]
    t0 = time.perf_counter()
    progress = []
    # outside the serial live loop a chunk loop's job ends at a chunk's start, its final chunk decoded in the next
    # job beside the next chunk's forwards (engine/live_loop.py), not as soon as it is final
    roles = getattr(family, "roles", None)
    overlap = roles is not None and roles.lane is not None
    for _ in range(max_steps):
        key = reqs[0].batch_key
        family.step(reqs)
        progress.append({r.spec.request_id: r.progress() for r in reqs})
        if any(r.denoised or r.batch_key != key or (r.chunk_start() if overlap and r.chunk_steps() else
                                                    r.decodable()) for r in reqs):
            break
    from longserve.engine.compile import compiled_graphs

    return StepResult(progress, time.perf_counter() - t0, compiled_graphs())


def decode_next(ctx, request_id: str, max_frames: int) -> DecodedChunk | None:
    """Decode the request's next final frames across the workers; rank 0 returns them (others None)."""
    req = ctx.state["requests"][request_id]
    if not req.decodable():
        raise RuntimeError(f"request {request_id!r} has no final frames to decode (steps {req.steps_done}/"
                           f"{req.num_steps}, frames {req.decoded_frames}/{req.num_frames})")
    start, vae_before = req.decoded_frames, req.timings["vae_s"]
    frames = ctx.state["family"].decode_next(req, max_frames)
    if ctx.pg.rank != 0:
        return None
    return DecodedChunk(frames, start, req.decoded_frames, req.num_frames, req.timings["vae_s"] - vae_before,
                        req.decoded_frames >= req.num_frames, req.progress(), dict(req.timings),
                        *req.handed_out())


def live_tick(ctx, request_ids: list[str], max_steps: int, decode_id: str, max_frames: int) -> LiveTick:
    """`decode_next(decode_id)` and `step(request_ids)` at once where the family has a decode lane (the causal
    family, outside the serial loop): the chunk is taken from the stream on every rank, decoded on the lane while the
    steps run, and waited for at the end. Elsewhere the one, then the other."""
    from longserve.engine.live_loop import begin_decode, finish_decode

    family = ctx.state["family"]
    req = ctx.state["requests"][decode_id]
    roles = getattr(family, "roles", None)
    if roles is None or roles.lane is None:
        chunk = decode_next(ctx, decode_id, max_frames)
        ran = step(ctx, request_ids, max_steps) if request_ids else None
        return LiveTick(ran, chunk, None if chunk is None else chunk.frames, 0.0 if chunk is None else chunk.vae_s,
                        0.0 if chunk is None else chunk.timings.get("vae_s", 0.0), ctx.pg.rank == 0)
    if not req.decodable() and not family.decode_only:       # the decode rank gets its chunk in `begin_decode`
        raise RuntimeError(f"request {decode_id!r} has no final frames to decode")
    pending = begin_decode(family, ctx, req, max_frames)
    meta = None
    if ctx.pg.rank == 0:      # the chunk's place as a serial decode reports it: before the steps that follow
        meta = DecodedChunk(None, pending.start, req.decoded_frames, req.num_frames, 0.0,
                            req.decoded_frames >= req.num_frames, req.progress(), dict(req.timings),
                            *req.handed_out())
    ran = step(ctx, request_ids, max_steps) if request_ids and ctx.pg.rank in roles.denoisers else None
    frames, vae_s = finish_decode(pending)
    lane = ctx.pg.rank == roles.lane
    if ctx.pg.rank != 0 and not lane:
        return LiveTick()
    return LiveTick(ran, meta, frames, vae_s, req.timings.get("vae_s", 0.0), lane)


def lane_thread(ctx) -> int | None:
    """The OS thread id of this worker's decode lane, when it runs one beside its steps (`bench live --pin` gives it
    a core of its own); None otherwise."""
    family = ctx.state["family"]
    roles, lane = getattr(family, "roles", None), getattr(family, "lane", None)
    if roles is None or lane is None or ctx.pg.rank not in roles.denoisers:
        return None
    return lane.thread_id()


def update(ctx, request_id: str, payload: dict) -> dict:
    """Change a running request between two steps (a live session: a new prompt, or stop); the family
    validated `payload` on the coordinator. Returns what the family says of it."""
    return ctx.state["family"].update(ctx.state["requests"][request_id], payload)


def prefetch_lora(ctx, paths: list[str]) -> None:
    """Read a LoRA file into the page cache on a thread of this worker (returns at once): the load that follows
    (`load_lora`, between two steps) then reads memory, not a disk, however slow the volume."""
    import threading

    def read() -> None:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    while f.read(8 << 20):
                        pass
            except OSError:
                pass                 # the load itself says what is wrong with the file

    thread = threading.Thread(target=read, name="lora-prefetch", daemon=True)
    thread.start()
    ctx.state.setdefault("lora_prefetch", []).append(thread)


def prefetched_lora(ctx) -> bool:
    """Whether this worker's LoRA file reads are done."""
    threads = [t for t in ctx.state.get("lora_prefetch", []) if t.is_alive()]
    ctx.state["lora_prefetch"] = threads
    return not threads


def load_lora(ctx, adapter) -> str | None:
    """Load a LoRA adapter into this worker's transformer(s) while serving (`engine.lora.LoraSet.add`): None, or
    why it did not fit (the model is left as it was; the pool stays up)."""
    from longserve.engine.lora import LoraSet

    family = ctx.state["family"]
    try:
        if family.lora is None:
            family.lora = LoraSet(family.pipe, ())
        family.lora.add(adapter)
    except ValueError as e:
        return str(e)
    return None


def unload_lora(ctx, name: str) -> None:
    family = ctx.state["family"]
    if family.lora is not None:
        family.lora.remove(name)


def release(ctx, request_ids: list[str]) -> None:
    for rid in request_ids:
        ctx.state["requests"].pop(rid, None)


def memory_start(ctx) -> None:
    """Start counting this worker's peak tensor memory (engine.memory.PeakMemory) across the jobs that follow."""
    from longserve.engine.memory import PeakMemory

    ctx.state["memory"] = PeakMemory(ctx.pg.device).__enter__()


def memory_stop(ctx) -> int:
    """Peak tensor bytes allocated (and alive at once) since `memory_start`, on this worker."""
    memory = ctx.state.pop("memory")
    memory.__exit__(None, None, None)
    return memory.peak_bytes


def work_start(ctx) -> None:
    """Start counting this worker's transformer forwards and attention token pairs (engine.workcount) across the
    jobs that follow."""
    from longserve.engine.workcount import WorkCounter

    ctx.state["work"] = WorkCounter().__enter__()


def work_stop(ctx) -> dict:
    """{"forwards", "self_pairs", "cross_pairs"} counted on this worker since `work_start`."""
    counter = ctx.state.pop("work")
    counter.__exit__(None, None, None)
    return counter.counts()

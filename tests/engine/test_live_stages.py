"""The stages live loop (engine/live_stages.py): the transformer's blocks split into one stage per worker, a stream
batch of chunks in flight through them. A stream batch of 1 makes the serial loop's numbers (on 2 and 3 workers, a
block count that does not divide by them, a prompt switch, past the window); a larger one changes them as
docs/design.md says (the group's first chunk is the serial loop's), the same from run to run; each worker caches its
own blocks only; switches keep their promise, stop and cancel hold; what cannot run is refused before any worker
loads. tests/pipelines/test_live_content.py checks what tiny-live shows with it."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from causal_models import (
    TINY_CAUSAL,
    TINY_DEFAULTS,
    build_tiny_causal,
    cancelled_at_first_chunk,
    stopped_session,
    switched_session,
)

from longserve.engine.config import EngineConfig
from longserve.engine.dist import ParallelGroup
from longserve.engine.live_stages import StagedCausal, stage_blocks
from longserve.engine.models.causal import CausalConfig, CausalWan, KVCache
from longserve.engine.outputs import Cancelled, FramesChunk, LiveChunkInfo
from longserve.engine.parallel import make_sequence_parallel
from longserve.pipelines import VideoPipeline
from longserve.weights.registry import TINY_MODELS
from tools.weights.build_causal import build_causal_checkpoint

H, W = 16, 80
CHUNKS = 7              # 21 latent frames: past the 15-frame window (1 sink frame): the ring evicts, the sink turns
FRAMES = 1 + (CHUNKS * 3 - 1) * 4
SCHEDULE = [[0, "a red ball bouncing"], [3, "a blue ball bouncing"]]      # a switch: the cache recomputed


@pytest.fixture(scope="module")
def five_blocks(tmp_path_factory):
    """tiny-wan's transformer with 5 blocks: 3 + 2 on two stages, 2 + 2 + 1 on three."""
    config = json.loads((TINY_MODELS["tiny-wan"] / "transformer" / "config.json").read_text())
    return build_causal_checkpoint(tmp_path_factory.mktemp("five") / "causal", {**config, "num_layers": 5},
                                   TINY_CAUSAL, defaults=TINY_DEFAULTS)


@pytest.fixture(scope="module")
def batched(five_blocks):
    """The stages loop on 2 workers with its default stream batch (2)."""
    with VideoPipeline.from_pretrained(str(five_blocks), workers=2, live_loop="stages") as p:
        yield p


def latents(p, seed: int = 1, prompt: str = "", **options) -> tuple[torch.Tensor, list]:
    options = options or {"prompt_schedule": SCHEDULE}
    spec = p.make_spec(prompt, num_frames=FRAMES, height=H, width=W, seed=seed, output_type="latent", **options)
    chunks = [o for o in p.engine.submit(spec) if isinstance(o, FramesChunk)]
    return torch.cat([torch.as_tensor(c.frames) for c in chunks], dim=2), [c.live for c in chunks]


def test_stages_are_contiguous_blocks_the_earlier_ones_one_more():
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="live_loop 'stages'"):
        stage_blocks(2, 3)


def test_a_stream_batch_of_one_makes_the_serial_loop_s_latents_and_a_larger_one_changes_them_as_documented(
        five_blocks, batched):
    image = np.full((H, W, 3), 128, np.uint8)
    image[4:12, 10:20] = (0, 0, 255)
    start = {"prompt": "a blue ball bouncing", "image": image}       # held in the cache by a staged forward
    with VideoPipeline.from_pretrained(str(five_blocks), workers=1) as p:
        want, infos = latents(p)
        want_image, _ = latents(p, **start)
    assert infos == [LiveChunkInfo(chunk=i, prompt_index=int(i >= 3)) for i in range(CHUNKS)]
    for workers in (2, 3):
        with VideoPipeline.from_pretrained(str(five_blocks), workers=workers, live_loop="stages",
                                           stream_batch=1) as p:
            got, got_infos = latents(p)
            if workers == 2:
                assert (latents(p, **start)[0] - want_image).abs().max() <= 1e-5
        assert got_infos == infos
        assert (got - want).abs().max() <= 1e-5, workers
    names, run = [], batched.pool.run

    def recording(fn, *args, **kw):
        names.append(fn.__name__)
        return run(fn, *args, **kw)

    batched.pool.run = recording
    try:
        stream, batched_infos = latents(batched)
    finally:
        batched.pool.run = run
    again, _ = latents(batched)
    # rank 0's lane decodes a chunk a job, beside the steps (a group runs in the job that takes the last's last chunk)
    assert "decode_next" not in names and names.count("live_tick") == CHUNKS
    assert batched_infos == infos
    assert torch.equal(stream, again)                                         # deterministic: the same seed
    fb = 3
    # the group's first chunk reads what the serial loop's reads; the second attends to the first's K/V at its own
    # noise level instead of clean: different numbers, the same kind of latents
    assert (stream[:, :, :fb] - want[:, :, :fb]).abs().max() <= 1e-5
    assert (stream[:, :, fb:2 * fb] - want[:, :, fb:2 * fb]).abs().max() > 1e-3
    assert torch.isfinite(stream).all() and abs(stream.std() / want.std() - 1) < 0.5


def test_each_stage_caches_its_own_blocks_only_and_admission_counts_the_largest(five_blocks):
    from longserve.engine.families.causal_wan import CausalWanFamily
    from longserve.weights.causal_wan import load_causal_transformer

    cfg = CausalConfig.from_dict(TINY_CAUSAL)
    causal = CausalWan(load_causal_transformer(five_blocks), cfg)
    cpu = torch.device("cpu")
    solo = make_sequence_parallel(ParallelGroup(0, 1, cpu), "ulysses")
    h, w, text = H // 8, W // 8, 512

    def size(c: KVCache) -> int:
        return sum(t.numel() * t.element_size() for t in (c.k, c.v, c.sink_k, c.text_k, c.text_v))

    stages = [StagedCausal(causal, ParallelGroup(r, 2, cpu), solo, 2).new_cache(h, w, solo, text) for r in range(2)]
    assert [c.k.shape[0] for c in stages] == [3, 2] and [c.first_layer for c in stages] == [0, 3]
    whole = causal.new_cache(h, w, solo, text)                      # the serial loop's: every block, one chunk
    assert max(map(size, stages)) <= 0.75 * size(whole)             # 3/5 of the blocks, a chunk's slots more
    # admission counts the largest stage's (`KVCache.nbytes` counts the sink's pre-RoPE copy twice: a bound)
    desc = CausalWanFamily.describe(five_blocks)
    spec = types.SimpleNamespace(height=H, width=W, batch_size=1)
    counted = CausalWanFamily.kv_bytes(desc, spec, EngineConfig(model=str(five_blocks), workers=2,
                                                                 live_loop="stages"))
    assert max(map(size, stages)) <= counted <= 1.01 * max(map(size, stages))


def test_what_cannot_run_is_refused_before_any_worker_loads(tmp_path):
    with pytest.raises(ValueError, match="live_loop 'stages'.*workers >= 2"):
        EngineConfig(live_loop="stages")
    with pytest.raises(ValueError, match="stream_batch"):
        EngineConfig(workers=2, live_loop="stages", stream_batch=0)
    with pytest.raises(ValueError, match="stream_batch"):
        EngineConfig(workers=2, stream_batch=2)                  # the serial loop has none
    with pytest.raises(ValueError, match="live_loop 'stages'.*tiny-wan"):
        VideoPipeline.from_pretrained("tiny-wan", workers=2, live_loop="stages")
    with pytest.raises(ValueError, match="3 workers for a transformer of 2 blocks"):
        VideoPipeline.from_pretrained(str(build_tiny_causal(tmp_path / "two")), workers=3, live_loop="stages")


def test_a_live_switch_stop_and_cancel_keep_their_promise_with_a_stream_batch(batched):
    p = batched
    seen, first_blue, session = switched_session(p, 7, H, W)
    # at the start of a group after the switch reached the workers (groups of 2: chunk 4, as chunk 1 comes out of
    # the job that made chunks 2 and 3; 6 if the client's switch came after the next group's job began)
    assert first_blue in (4, 6) and all(p_ == int(i >= first_blue) for i, p_ in seen)
    assert first_blue <= session.last_switch.by_chunk                 # the engine's promise holds
    assert [i for i, _ in seen] == list(range(8))

    chunks, session = stopped_session(p, H, W)
    got = [c.index for c in chunks]
    # the chunks made already (a group is made whole) and at most the one the stop leaves to come
    assert 2 <= len(got) <= 5 and got == list(range(len(got)))
    assert session.handle.status().state.value == "finished_completed"

    outs, handle = cancelled_at_first_chunk(p, H, W)
    assert isinstance(outs[-1], Cancelled) and handle.status().state.value == "finished_cancelled"
    assert sum(isinstance(o, FramesChunk) for o in outs) <= 3
    again = list(p.stream("a red ball bouncing", num_frames=9, height=H, width=W, seed=0))
    assert len(again) == 1 and again[0].shape == (9, H, W, 3)


def test_a_switch_promises_the_chunk_after_the_group_a_job_may_be_making():
    """A job makes a whole group: a switch that reaches a request reported at chunk k applies by chunk k + B (the
    group from k may be in the making), not k + 1."""
    from scheduler_harness import spec

    from longserve.engine.results import Progress
    from longserve.engine.scheduler import Scheduler

    sched = Scheduler(EngineConfig(workers=2, live_loop="stages"))
    req = sched.submit(spec("live"))
    sched.schedule()                                                     # admitted
    sched.stepped(req, Progress(10, ("causal",), False, 100, chunk=4, chunk_steps=5, chunks_per_job=2))
    assert sched.switch("live", {"prompt": "a blue ball bouncing"}).by_chunk == 6


def test_bench_live_reports_the_stages_loop_on_two_workers_or_more():
    from tools.bench.live_loops import combos

    assert combos([1, 2], ["serial", "stages"]) == [(1, "serial"), (2, "serial"), (2, "stages")]

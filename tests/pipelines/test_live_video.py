"""Causal few-step Wan models (engine/families/causal_wan.py): the cached chunk loop against a recompute
reference, N workers against one, the released checkpoints' layout, prompt schedules and switches,
stop, the KV budget, and a stream past Wan's RoPE table with flat memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from causal_models import TINY_CAUSAL, build_tiny_causal, recompute_reference, stopped_session, switched_session

from longserve.engine.config import EngineConfig
from longserve.engine.engine import VideoEngine
from longserve.engine.outputs import FramesChunk, LiveChunkInfo
from longserve.engine.request import RequestError
from longserve.engine.scheduler import KVBudgetError
from longserve.pipelines import VideoPipeline

H, W, CHUNKS = 16, 80, 4            # 5 tokens per latent frame, 15 per chunk: not divisible by 2 or 4
FRAMES = 1 + (CHUNKS * 3 - 1) * 4   # 45 frames = 12 latent frames = 4 chunks of 3


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    return build_tiny_causal(tmp_path_factory.mktemp("causal") / "tiny-causal")


@pytest.fixture(scope="module")
def pipe(causal_dir):
    with VideoPipeline.from_pretrained(str(causal_dir), workers=1) as p:
        yield p


def latents(pipe, **kw):
    return pipe("a red ball bouncing", seed=0, num_frames=FRAMES, height=H, width=W, output_type="latent",
                **kw).frames


def test_upstream_layout_loads_with_no_missing_or_unexpected_keys(tmp_path):
    """A training checkpoint written with the released generators' names (listed here by hand from the original
    Wan module tree, not by our converter) loads strictly and equals the model it came from."""
    from diffusers import WanTransformer3DModel

    from longserve.weights.causal_wan import load_causal_transformer, read_generator

    d = build_tiny_causal(tmp_path / "pt", weights_name="self_forcing_dmd.pt")
    sd = read_generator(d / "self_forcing_dmd.pt", "generator_ema")
    attn = [f"{p}.{n}" for p in ("q", "k", "v", "o") for n in ("weight", "bias")] + ["norm_q.weight", "norm_k.weight"]
    block = ([f"self_attn.{a}" for a in attn] + [f"cross_attn.{a}" for a in attn] +
             ["norm3.weight", "norm3.bias", "ffn.0.weight", "ffn.0.bias", "ffn.2.weight", "ffn.2.bias", "modulation"])
    top = ["patch_embedding.weight", "patch_embedding.bias", "text_embedding.0.weight", "text_embedding.0.bias",
           "text_embedding.2.weight", "text_embedding.2.bias", "time_embedding.0.weight", "time_embedding.0.bias",
           "time_embedding.2.weight", "time_embedding.2.bias", "time_projection.1.weight", "time_projection.1.bias",
           "head.head.weight", "head.head.bias", "head.modulation"]
    expected = {f"model.{k}" for k in top} | {f"model.blocks.{i}.{k}" for i in range(2) for k in block}
    assert set(sd) == expected
    model = load_causal_transformer(d)                     # strict: raises on a missing or unexpected key
    ref = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(d / "transformer"))
    assert set(model.state_dict()) == set(ref.state_dict())
    assert torch.equal(model.blocks[1].attn2.to_out[0].weight, sd["model.blocks.1.cross_attn.o.weight"])
    assert torch.equal(model.blocks[0].norm2.weight, sd["model.blocks.0.norm3.weight"])   # norm2/norm3 swap
    del sd["model.blocks.1.ffn.2.bias"]
    torch.save({"generator_ema": sd}, d / "self_forcing_dmd.pt")
    with pytest.raises(ValueError, match="missing.*blocks.1.ffn.net.2.bias"):
        load_causal_transformer(d)


def test_cached_chunks_equal_a_recompute_and_two_and_three_workers_equal_one(pipe, causal_dir):
    ref = recompute_reference(causal_dir, "a red ball bouncing", 0, CHUNKS, H, W)
    one = latents(pipe)
    assert one.shape == ref.shape == (1, 8, 12, 2, 10)
    assert (one - ref).abs().max() <= 1e-5
    assert ref[:, :, 3:].std() > 0.1                       # later chunks are not trivially equal
    for workers in (2, 3):
        with VideoPipeline.from_pretrained(str(causal_dir), workers=workers) as p:
            assert (latents(p) - one).abs().max() <= 1e-5


def test_the_cache_keeps_its_sinks_and_moves_them_up_to_the_window_past_it(causal_dir):
    """Keys sit at their frame's index; once frames are evicted the sink is re-rotated just before the oldest kept
    frame, so the positions a chunk sees are the cache-relative ones shifted by a constant: every distance from the
    chunk to a cached frame is under local_attn_size."""
    from longserve.engine.models.causal import CausalConfig, KVCache

    cfg = CausalConfig.from_dict({**TINY_CAUSAL, "local_attn_size": 9, "sink_size": 1})   # 6 cached: 1 sink + 5
    cache = KVCache(cfg, 1, 2, 1, 4, 3, 1, torch.float32, "cpu")
    for _ in range(5):
        cache.commit(3)
    assert cache.slot_frame[0] == 0                                    # the sink is never evicted
    assert sorted(cache.slot_frame[1:]) == [10, 11, 12, 13, 14]         # the ring: the 5 most recent frames
    asked = []

    def rotary(start, frames):
        asked.append((start, frames))
        return torch.ones(frames * 2, 4), torch.zeros(frames * 2, 4)

    cache.prepare(3, rotary)
    assert asked == [(9, 1), (15, 3)]          # the sink at 9, right before frame 10; the chunk at 15..17
    assert cache.sink_rotations == 1 and cache._chunk[2] == 6 * 2   # the chunk's slots follow the 6 cached
    cache.prepare(3, rotary)                   # the chunk's next forward: nothing rotated again
    assert len(asked) == 2


def test_a_prompt_schedule_switches_at_its_chunk_and_a_live_switch_at_the_next(pipe):
    red = list(pipe.engine.submit(pipe.make_spec("a red ball bouncing", num_frames=FRAMES, height=H, width=W,
                                                 seed=1)))
    red_chunks = [o for o in red if isinstance(o, FramesChunk)]
    spec = pipe.make_spec("", num_frames=FRAMES, height=H, width=W, seed=1,
                          prompt_schedule=[[0, "a red ball bouncing"], [2, "a blue ball bouncing"]])
    chunks = [o for o in pipe.engine.submit(spec) if isinstance(o, FramesChunk)]
    assert [c.live for c in chunks] == [LiveChunkInfo(chunk=i, prompt_index=int(i >= 2)) for i in range(4)]
    for a, b in zip(red_chunks[:2], chunks[:2]):                   # the same frames until the switch ...
        np.testing.assert_array_equal(a.frames, b.frames)
    assert np.abs(red_chunks[2].frames - chunks[2].frames).max() > 1e-3   # ... and other ones from it on
    # the Python stream API takes the same schedule
    frames = list(pipe.stream([(0, "a red ball bouncing"), (2, "a blue ball bouncing")], num_frames=FRAMES,
                              height=H, width=W, seed=1))
    np.testing.assert_array_equal(np.concatenate(frames), np.concatenate([c.frames[0] for c in chunks]))

    seen, first_blue, session = switched_session(pipe, 5, H, W)
    assert first_blue in (2, 3) and all(p == int(i >= first_blue) for i, p in seen)
    # what the engine promised when it took the switch (the server's `prompt.received`) holds
    assert session.last_switch.by_chunk in (2, 3) and first_blue <= session.last_switch.by_chunk


def test_stop_ends_a_live_session_after_the_chunk_it_is_making(pipe):
    got, session = stopped_session(pipe, H, W)
    assert 2 <= len(got) <= 3 and [c.index for c in got] == list(range(len(got)))
    assert session.handle.status().state.value == "finished_completed"
    assert session.timings["transformer_s"] > 0


def test_bad_requests_name_the_field(pipe):
    with pytest.raises(RequestError, match="guidance") as e:
        pipe("x", height=H, width=W, guidance_scale=5.0)
    assert e.value.field == "guidance_scale"
    with pytest.raises(RequestError) as e:
        pipe("x", height=H, width=W, num_inference_steps=8)
    assert e.value.field == "num_inference_steps"
    with pytest.raises(RequestError) as e:
        list(pipe.stream([(1, "late start")], height=H, width=W))
    assert e.value.field == "prompt_schedule"
    session = pipe.live("a red ball bouncing", seconds=60, height=H, width=W)
    with pytest.raises(RequestError) as e:
        session.switch("  ")
    assert e.value.field == "prompt"
    session.close()


def test_a_session_past_the_kv_budget_is_refused_with_a_clear_error(causal_dir):
    with VideoEngine.start(EngineConfig(model=str(causal_dir), live_kv_budget=0.5)) as engine:
        spec = lambda: VideoPipeline(engine).make_spec("a", num_frames=FRAMES, height=H, width=W,  # noqa: E731
                                                       live=True)
        first = engine.submit(spec())
        need = first._req.kv_bytes
        assert 0 < need <= 0.5 * 2**20 < 2 * need              # one fits, two do not
        with pytest.raises(KVBudgetError, match=r"live KV budget is full: 1 session\(s\) hold .* MiB"):
            engine.submit(spec())
        first.cancel()
        assert list(first)[-1].__class__.__name__ == "Cancelled"
        second = engine.submit(spec())                          # its bytes were given back
        assert [o for o in second if isinstance(o, FramesChunk)]




@pytest.mark.parametrize("live_loop", ["serial", "pipelined", "stages"])
def test_a_stream_of_2000_latent_frames_past_the_rope_table_keeps_per_worker_memory_flat(tmp_path, live_loop):
    """Wan's rotary table has `rope_max_seq_len` (1024) frame positions; a causal stream never uses more than
    `local_attn_size` of them apart, and positions past it are computed as the table is (FrameRotary), so it
    runs on past it, and each worker's peak tensor memory
    (engine/memory.py, the tracker on) over 20 chunks (2000 latent frames, 17 of them evicting from the cache)
    is that over 3 within 5%. Chunks of 100 latent frames and one denoising step keep the tracked run short
    (the tracker's cost is per op); 2 workers, Ulysses pads the 3 heads; or pipelined (engine/live_loop.py: the
    transformer on worker 0, the chunks handed to worker 1); or stages (engine/live_stages.py: a block per worker,
    groups of 2 chunks in flight)."""
    from longserve.engine import worker
    from longserve.weights.causal_wan import load_causal_transformer

    model = build_tiny_causal(tmp_path / "long", num_frame_per_block=100, denoising_step_list=[1000],
                              local_attn_size=250, sink_size=4)
    assert load_causal_transformer(model).config.rope_max_seq_len < 2000
    peaks = {}
    with VideoPipeline.from_pretrained(str(model), workers=2, live_loop=live_loop) as p:
        for chunks in (3, 20):
            p.pool.run(worker.memory_start)
            out = p("a red ball bouncing", num_frames=1 + (chunks * 100 - 1) * 4, height=16, width=16,
                    num_inference_steps=1, seed=0, output_type="latent").frames
            peaks[chunks] = p.pool.run(worker.memory_stop)
            assert out.shape[2] == chunks * 100 and torch.isfinite(out).all()
    assert all(0 < b <= 1.05 * a for a, b in zip(peaks[3], peaks[20])), peaks


def blue_ball(height: int, width: int) -> np.ndarray:
    """A blue ball on mid grey (the trained models' background), as an (H, W, 3) uint8 image."""
    image = np.full((height, width, 3), 128, np.uint8)
    yy, xx = np.mgrid[:height, :width]
    image[(yy - height / 2) ** 2 + (xx - width / 3) ** 2 <= (height / 3) ** 2] = (0, 0, 255)
    return image


def image_and_decode(causal_dir, image):
    """The plain way, with diffusers' own VAE: the image's normalised latent frame (1, C, 1, h, w), as Wan's I2V
    pipelines encode a first frame, and a function decoding a whole video's normalised latents in one call, as the
    Wan pipelines do (T, H, W, 3) in [0, 1]."""
    from diffusers import AutoencoderKLWan
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    vae = AutoencoderKLWan.from_pretrained(causal_dir / "vae")
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    pixels = VideoProcessor(vae_scale_factor=8).preprocess(Image.fromarray(image), height=H, width=W)
    with torch.no_grad():
        latent = (vae.encode(pixels[:, :, None]).latent_dist.mode() - mean) / std

    def decode(latents):
        with torch.no_grad():
            video = vae.decode(latents.float() * std + mean).sample[0]
        return (video / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).numpy()

    return latent, decode


def test_a_start_image_is_the_first_frame_and_context_in_jobs_and_sessions_and_two_workers_equal_one(pipe,
                                                                                                       causal_dir):
    """As Self-Forcing's inference with an initial latent: the image is VAE-encoded and written into the cache before
    the first chunk, and the video is [image latent | the chunks' latents], decoded as one: frame 0 is the image's,
    and the chunks after it attend to it. num_frames is the video's length, the image's frame included; chunk 0
    carries the image's frame, `temporal` frames more than without one. A session takes it too (`pipe.live(prompt,
    image=...)`: its chunk 0 is the job's), and 2 workers (Ulysses, 3 heads padded) make what 1 makes."""
    image = blue_ball(H, W)
    image_latent, decode = image_and_decode(causal_dir, image)
    plain, held = latents(pipe), latents(pipe, image=image)
    assert held.shape == plain.shape                                  # 12 latent frames: the image's and 11 made
    assert (held[:, :, :1] - image_latent).abs().max() <= 1e-5
    assert (held[:, :, 1:4] - plain[:, :, :3]).abs().max() > 1e-2    # the first chunk attends to it
    video = pipe("a red ball bouncing", seed=0, num_frames=FRAMES, height=H, width=W, image=image).frames[0]
    assert video.shape == (FRAMES, H, W, 3)
    # the whole video decoded in one call; a live chunk's frames leave the worker as uint8 (engine/live_frames.py):
    # "np" is uint8 / 255, at most half a level from the float32 decode
    assert np.abs(video - decode(held)).max() <= 0.5 / 255 + 1e-4
    with pipe.live("a red ball bouncing", seconds=1.0, height=H, width=W, seed=0, image=image) as session:
        first = np.asarray(next(iter(session)).frames)
    with pipe.live("a red ball bouncing", seconds=1.0, height=H, width=W, seed=0) as session:
        no_image = np.asarray(next(iter(session)).frames)
    assert len(first) == 1 + 3 * 4 and len(no_image) == 1 + 2 * 4
    np.testing.assert_array_equal(first, video[:len(first)])
    with VideoPipeline.from_pretrained(str(causal_dir), workers=2) as p:
        assert (latents(p, image=image) - held).abs().max() <= 1e-5
        with p.live("a red ball bouncing", seconds=1.0, height=H, width=W, seed=0, image=image) as session:
            # within a level: 2 workers' latents are 1 worker's within 1e-5, which may cross a uint8 rounding edge
            assert np.abs(np.asarray(next(iter(session)).frames) - first).max() <= 1 / 255 + 1e-4
    with pytest.raises(RequestError) as e:
        latents(pipe, image="not an image")
    assert e.value.field == "image"
    with pytest.raises(RequestError) as e:                            # the image's frame and nothing made
        pipe("a red ball bouncing", num_frames=1, height=H, width=W, image=image)
    assert e.value.field == "num_frames"


def test_a_bfloat16_session_runs_and_follows_the_float32_one(causal_dir):
    """On a GPU a session runs in bfloat16. diffusers keeps some of the transformer's modules in float32 (the first
    parameter, `scale_shift_table`, is one): the KV cache and the RoPE rows must take the compute dtype, not the
    first parameter's, or the first chunk fails on mixed query / key dtypes."""
    want = latents_of(causal_dir, "float32")
    got = latents_of(causal_dir, "bfloat16", vae_dtype="bfloat16")   # and a bf16 VAE encoding the start image
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()     # bf16 rounding, not another video


def latents_of(causal_dir, dtype, **kw):
    with VideoPipeline.from_pretrained(str(causal_dir), workers=1, dtype=dtype, **kw) as p:
        return p("a red ball bouncing", seed=0, num_frames=9, height=H, width=W, output_type="latent",
                 image=blue_ball(H, W)).frames


def test_tiny_live_on_two_workers_equals_one_past_the_window_through_a_switch(pipeline):
    """Stored-rotated keys per worker (Ulysses: each its own heads), the sink re-rotated once per chunk, a recache at
    the switch: 8 chunks of tiny-live (the window full from chunk 3) on 2 workers make what 1 makes."""
    kw = dict(seed=3, num_frames=24, output_type="latent",
              prompt_schedule=[[0, "a red ball bouncing"], [4, "a blue ball bouncing"]])
    one, two = (torch.as_tensor(pipeline("tiny-live", workers=w)("", **kw).frames) for w in (1, 2))
    assert one.shape == (1, 4, 24, 8, 8) and one[:, :, 12:].std() > 0.1
    assert (one - two).abs().max() <= 1e-5

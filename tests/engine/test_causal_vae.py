"""StreamingVAEDecoder decodes Wan latents chunk by chunk across workers exactly as diffusers' vae.decode.

One pool of 3 gloo workers serves every multi-worker case; sub-groups of its first 1, 2 and
3 ranks give the smaller worker counts. Single-process cases use a one-rank ParallelGroup
(no collective runs at world size 1).

Reference: diffusers' `AutoencoderKLWan.decode` on the whole video, with `enable_tiling(same
settings)` for the tiled cases. diffusers decodes the batch together; the streaming decoder
decodes one video per work item, so it is bitwise equal to diffusers' decode of each video
alone and within ATOL of the batched decode (batched and per-video convolutions round
differently).
"""

import pytest
import torch
import torch.distributed as dist

from longserve.engine import comm
from longserve.engine.causal_vae import StreamingVAEDecoder, VAETiling, assign_items
from longserve.engine.dist import ParallelGroup
from longserve.engine.memory import PeakMemory
from longserve.engine.pool import WorkerError, WorkerPool
from tools.bench.models import random_wan_vae

ATOL = 1e-5
WORKERS = (1, 2, 3)
# 56x40 pixels = a 7x5 latent; 32-pixel tiles every 24 pixels = 4-latent tiles every 3: a 3x2 grid
# whose last row is 1 latent pixel high and last column 2 wide (tile areas 16, 8, 16, 8, 4, 2).
TILING = VAETiling(32, 32, 24, 24)
HEIGHT, WIDTH = 7, 5


# 2 shared cores: two intra-op threads fighting other processes' threads run 10-40x slower
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(3, device="cpu") as p:
        yield p


def latents(batch, frames, height=HEIGHT, width=WIDTH, seed=1):
    return torch.randn(batch, 4, frames, height, width, generator=torch.Generator().manual_seed(seed))


def diffusers_decode(z, tiling, per_video=False, patch_size=None):
    vae = random_wan_vae(patch_size=patch_size)
    if tiling is not None:
        vae.enable_tiling(tiling.sample_min_height, tiling.sample_min_width,
                          tiling.sample_stride_height, tiling.sample_stride_width)
    with torch.no_grad():
        if per_video:
            return torch.cat([vae.decode(z[b:b + 1]).sample for b in range(z.shape[0])])
        return vae.decode(z).sample


def stream(vae, pg, z, chunk, tiling, dst=0, keep=True):
    """Decode `z` in chunks of `chunk` latent frames; the outputs concatenated (dst) and per-chunk None-ness."""
    decoder = StreamingVAEDecoder(vae, pg, z.shape[0], z.shape[3], z.shape[4], tiling=tiling, dst=dst)
    outs, shapes = [], []
    for start in range(0, z.shape[2], chunk):
        out = decoder.decode(z[:, :, start:start + chunk])
        shapes.append(None if out is None else tuple(out.shape))
        if keep:
            outs.append(out)
    assert decoder.latent_frames_done == z.shape[2]
    decoder.close()
    video = torch.cat(outs, dim=2) if keep and outs[0] is not None else None
    return video, shapes


def single_rank():
    return ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))


# -- one worker: equal to diffusers --------------------------------------------------------


@pytest.mark.parametrize("tiling", [TILING, None], ids=["tiling-on-frame-fits-one-tile", "tiling-off"])
def test_one_worker_equals_diffusers_plain_decode(tiling):
    z = latents(2, 4, height=4, width=3)  # 32x24 pixels: one 32-pixel tile
    want = diffusers_decode(z, tiling)
    per_video = diffusers_decode(z, tiling, per_video=True)
    vae = random_wan_vae()
    for chunk in (1, 3, 4):
        got, _ = stream(vae, single_rank(), z, chunk, tiling)
        assert got.shape == want.shape == (2, 3, 13, 32, 24)
        assert torch.equal(got, per_video), chunk
        assert (got - want).abs().max().item() <= ATOL, chunk
    assert not vae.use_tiling and not hasattr(vae, "_feat_map")  # the VAE's own state is untouched


def test_one_worker_equals_diffusers_tiled_decode_on_an_uneven_tile_grid():
    z = latents(2, 4)
    want = diffusers_decode(z, TILING)
    per_video = diffusers_decode(z, TILING, per_video=True)
    assert (want - diffusers_decode(z, None)).abs().max() > 0.1  # tiling changes the pixels: the test sees it
    assert 0.1 < want.std() and (want.abs() == 1).float().mean() < 0.01  # unit-scale, barely clamped
    vae = random_wan_vae()
    shapes = {}
    for chunk in (1, 3, 4):
        got, shapes[chunk] = stream(vae, single_rank(), z, chunk, TILING)
        assert got.shape == want.shape == (2, 3, 13, 56, 40)
        assert torch.equal(got, per_video), chunk
        assert (got - want).abs().max().item() <= ATOL, chunk
    assert shapes[4] == [(2, 3, 13, 56, 40)]  # one-shot: 1 + 4 + 4 + 4 pixel frames
    assert [s[2] for s in shapes[3]] == [9, 4]  # latent frame 0 gives 1 pixel frame, the others 4


def test_one_worker_equals_diffusers_on_a_patchified_wan22_vae():
    # Wan 2.2's residual VAE: 16x spatial, 12 decoder channels unpatchified to 3; a 3x2 grid of 8-latent tiles
    tiling = VAETiling(128, 128, 96, 96)
    z = latents(1, 3, height=14, width=10)
    want = diffusers_decode(z, tiling, patch_size=2)
    got, _ = stream(random_wan_vae(patch_size=2), single_rank(), z, 2, tiling)
    assert got.shape == want.shape == (1, 3, 9, 224, 160)
    assert torch.equal(got, want)


def test_items_go_largest_first_to_the_least_loaded_rank():
    assert assign_items([1] * 5, 2) == [[0, 2, 4], [1, 3]]  # equal tiles: round-robin
    assert assign_items([1] * 4, 3, first=2) == [[1], [2], [0, 3]]  # ... starting at dst
    # one video's 3x2 grid: round-robin would give rank 0 all three 16-area tiles
    areas = [16, 8, 16, 8, 4, 2]
    owned = assign_items(areas, 2)
    assert sorted(sum(owned, [])) == list(range(6))
    assert [sum(areas[i] for i in o) for o in owned] == [28, 26]


@pytest.mark.parametrize("bad, field", [
    (latents(3, 2), "batch"),
    (torch.randn(2, 5, 2, HEIGHT, WIDTH), "channels"),
    (latents(2, 2, height=6), "height"),
    (latents(2, 2, width=4), "width"),
    (latents(2, 0), "at least one latent frame"),
    (torch.randn(2, 4, HEIGHT, WIDTH), "5-D"),
])
def test_wrong_chunk_raises_value_error_naming_the_field(bad, field):
    decoder = StreamingVAEDecoder(random_wan_vae(), single_rank(), 2, HEIGHT, WIDTH, tiling=TILING)
    with pytest.raises(ValueError, match=field):
        decoder.decode(bad)
    assert decoder.latent_frames_done == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(batch_size=0), "batch_size"),
    (dict(latent_height=-1), "latent_height"),
    (dict(dst=1), "dst"),
    (dict(tiling=(32, 32, 24, 24)), "tiling"),
    (dict(tiling=VAETiling(32, 32, 4, 4)), "sample_stride_height"),
])
def test_wrong_setup_raises_value_error_naming_the_argument(kwargs, field):
    args = dict(batch_size=2, latent_height=HEIGHT, latent_width=WIDTH, tiling=TILING) | kwargs
    with pytest.raises(ValueError, match=field):
        StreamingVAEDecoder(random_wan_vae(), single_rank(), **args)
    with pytest.raises(ValueError, match="sample_stride_width"):
        VAETiling(32, 32, 24, 40)


# -- several workers ----------------------------------------------------------------------


def _subgroups(ctx):
    if "groups" not in ctx.state:
        groups = {}
        for n in WORKERS:
            handle = dist.new_group(list(range(n)))  # every rank must call new_group
            if ctx.pg.rank < n:
                groups[n] = ctx.pg.subgroup(list(range(n)), handle)
        ctx.state["groups"] = groups
    return ctx.state["groups"]


def _stream_on(ctx, n, z, chunk, tiling, dst=0, measure=False):
    """On the first n ranks: stream-decode z; every rank's (video or None, shapes, peak bytes, comm)."""
    pg = _subgroups(ctx).get(n)
    if pg is None:
        return None
    torch.manual_seed(0)
    vae = random_wan_vae()
    comm.STATS.reset()
    with PeakMemory("cpu", enabled=measure) as mem:
        video, shapes = stream(vae, pg, z, chunk, tiling, dst=dst, keep=not measure)
    return dict(video=video, shapes=shapes, peak=mem.peak_bytes, comm=comm.STATS.snapshot())


def _bad_chunk(ctx):
    pg = _subgroups(ctx)[3]
    StreamingVAEDecoder(random_wan_vae(), pg, 2, HEIGHT, WIDTH, tiling=TILING).decode(latents(1, 2))


def test_two_and_three_workers_equal_one_worker_and_diffusers_on_a_batch_of_two(pool):
    z = latents(2, 4)  # 12 items of 6 sizes: neither 2 nor 3 ranks get equal areas
    want = diffusers_decode(z, TILING)
    one, _ = stream(random_wan_vae(), single_rank(), z, 3, TILING)
    for n in (2, 3):
        got = pool.run(_stream_on, n, z, 3, TILING)
        assert torch.equal(got[0]["video"], one), n
        assert (got[0]["video"] - want).abs().max().item() <= ATOL, n
        assert all(r["video"] is None for r in got[1:n])


def test_one_untiled_video_on_three_workers_is_decoded_by_dst_alone(pool):
    z = latents(1, 3, height=4, width=3)
    want = diffusers_decode(z, None)
    got = pool.run(_stream_on, 3, z, 2, None, 1)
    assert torch.equal(got[1]["video"], want)
    assert got[0]["video"] is None and got[2]["video"] is None
    assert [r["comm"]["calls"] for r in got] == [{}, {}, {}]  # nothing to gather


def test_output_comes_only_on_dst_and_the_others_send_their_tiles_once_per_chunk(pool):
    z = latents(2, 3)
    want = diffusers_decode(z, TILING, per_video=True)
    got = pool.run(_stream_on, 3, z, 2, TILING, 2)
    assert torch.equal(got[2]["video"], want)
    assert got[2]["shapes"] == [(2, 3, 5, 56, 40), (2, 3, 4, 56, 40)]
    for rank in (0, 1):
        assert got[rank]["video"] is None and got[rank]["shapes"] == [None, None]
        assert got[rank]["comm"]["calls"] == {"gather": 2}
        assert got[rank]["comm"]["bytes_sent"] > 0
    assert got[2]["comm"]["bytes_sent"] == 0


def test_a_wrong_chunk_fails_naming_the_field_before_any_collective(pool):
    # the decoder's own checks guard its callers (a family), not a client's input: an internal error, and
    # the pool restarts under engine/pool.py's policy; the check runs before the gather, so nothing is sent
    restarts = pool.restarts
    with pytest.raises(WorkerError, match="ValueError: z: batch must be 2") as e:
        pool.run(_bad_chunk)
    assert e.value.kind == "internal" and pool.restarts == restarts + 1


# -- memory ---------------------------------------------------------------------------------


def test_peak_memory_per_worker_does_not_grow_with_video_length(pool):
    # Decoding latent frame k >= 2 allocates the same tensors whatever k is (the caches hold 2 frames
    # per causal conv from then on), so 1-frame chunks of a 3- and a 9-latent-frame video peak alike
    # (measured: equal to the byte on both ranks). The 2% allows for gloo's thread letting go of a
    # collective buffer a little later under load (engine/memory.py). Keeping one chunk's decoded tiles
    # per latent frame would add 6 chunks: +25% on rank 0 (tried: 2.05 -> 2.57 MB).
    short = pool.run(_stream_on, 2, latents(1, 3), 1, TILING, 0, True)
    long = pool.run(_stream_on, 2, latents(1, 9), 1, TILING, 0, True)
    for rank in (0, 1):
        assert long[rank]["peak"] <= 1.02 * short[rank]["peak"], rank
    one_shot = pool.run(_stream_on, 2, latents(1, 9), 9, TILING, 0, True)
    assert one_shot[0]["peak"] > 1.2 * long[0]["peak"]  # the measure sees a whole video's frames


def test_peak_memory_per_worker_at_two_workers_is_below_one_worker(pool):
    # Each of 2 workers holds the caches of about half the tile area (28 and 26 of 54 latent pixels);
    # one item-frame's activations and dst's gathered chunk do not shrink, so not quite half
    # (measured: 1.94 and 1.77 MB against 2.83 MB, 0.69x; 3 workers 0.59x).
    z = latents(1, 3)
    one = pool.run(_stream_on, 1, z, 1, TILING, 0, True)[0]["peak"]
    two = [r["peak"] for r in pool.run(_stream_on, 2, z, 1, TILING, 0, True)[:2]]
    assert max(two) < 0.85 * one, (two, one)


def test_the_decoder_never_gives_sdpa_a_stride_cuda_memory_efficient_attention_rejects(monkeypatch):
    """Found on an H100 (docs/gpu.md): the decoder's geometry probe decoded a 1x1 latent, so the VAE's
    middle attention saw a length-1 sequence whose (degenerate) stride is 1, and CUDA's memory-efficient
    SDPA kernel refuses it ("query is not correctly aligned (strideM)"). CPU SDPA has no such rule, so
    the rule is checked here: every q/k/v sequence stride a multiple of 4 elements (16 bytes of fp32)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    seen = []

    def strict_sdpa(q, k, v, *args, **kwargs):
        for name, t in (("query", q), ("key", k), ("value", v)):
            seen.append(t.shape[-2])
            assert t.stride(-2) % 4 == 0, f"{name} is not correctly aligned (strideM): {tuple(t.stride())}"
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", strict_sdpa)
    z = latents(1, 2, height=4, width=3)
    got, _ = stream(random_wan_vae(), single_rank(), z, 1, None)
    assert seen and got.shape == (1, 3, 5, 32, 24)

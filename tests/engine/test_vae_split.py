"""The VAE decode split by rows across workers (engine/vae_split.py) equals the one-worker untiled decode, streamed in
time, on tiny-wan's, a patchified Wan 2.2-shaped, tiny-hunyuan15's and tiny-ltx2's VAEs at 1-4 workers, with frames
whose latent rows do not divide by the workers (7 rows on 2, 3 and 4: bands 4/3, 3/2/2, 2/2/2/1).

A band that skipped its halo exchange (zero rows where a neighbour's rows belong) or kept its attention to its own
rows would differ along every band edge: `test_a_band_without_its_halo_differs` pins that the check can fail.

One shared pool of four gloo workers (`bare_pool4`), sub-groups of its first 1..4 ranks; each worker loads a VAE once.
"""

import pytest
import torch
import torch.distributed as dist

from longserve.engine.causal_vae import StreamingVAEDecoder
from longserve.engine.dist import ParallelGroup
from longserve.engine.vae_split import RowSplit, RowSplitWanDecoder, row_bands, split_rows_fits
from longserve.weights import resolve_model

ATOL = 2e-5    # fp32 rounding: the convolutions block by band height; the decoder's inner activations run at a
               # larger scale than its clamped frames (1.02e-5 at 4 workers on an AVX2-only EPYC, under 1e-5 on AVX-512)
WORKERS = (1, 2, 3, 4)
HEIGHT, WIDTH = 7, 5          # latent rows and columns: uneven bands at 2, 3 and 4 workers


def _vae(ctx, name):
    cache = ctx.state.setdefault("split_vaes", {})
    if name not in cache:
        torch.manual_seed(0)
        if name == "tiny-wan":
            from diffusers import AutoencoderKLWan

            cache[name] = AutoencoderKLWan.from_pretrained(str(resolve_model("tiny-wan")), subfolder="vae").eval()
        elif name == "wan22":
            from tools.bench.models import random_wan_vae

            cache[name] = random_wan_vae(patch_size=2)
        elif name == "tiny-hunyuan15":
            from diffusers import AutoencoderKLHunyuanVideo15

            cache[name] = AutoencoderKLHunyuanVideo15.from_pretrained(str(resolve_model(name)), subfolder="vae").eval()
        else:
            from diffusers import AutoencoderKLLTX2Video

            cache[name] = AutoencoderKLLTX2Video.from_pretrained(str(resolve_model(name)), subfolder="vae").eval()
    return cache[name]


def _groups(ctx):
    if "split_groups" not in ctx.state:
        groups = {}
        for n in WORKERS:
            handle = dist.new_group(list(range(n))) if n > 1 else None   # every rank must call new_group
            if ctx.pg.rank < n:
                groups[n] = ctx.pg.subgroup(list(range(n)), handle) if n > 1 else \
                    ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))
        ctx.state["split_groups"] = groups
    return ctx.state["split_groups"]


def _decode(name, vae, pg, z, chunks, rows):
    """z decoded in `chunks` of latent frames, rows split over pg (or whole frames on one rank: rows False)."""
    outs, start = [], 0
    with torch.no_grad():
        if name in ("tiny-wan", "wan22"):
            dec = RowSplitWanDecoder(vae, pg, z.shape[0], z.shape[3], z.shape[4]) if rows else \
                StreamingVAEDecoder(vae, pg, z.shape[0], z.shape[3], z.shape[4])
            parts = []
            for k in chunks:
                parts.append(dec.decode(z[:, :, start:start + k]))
                start += k
            dec.close()
        elif name == "tiny-hunyuan15":
            from longserve.engine.families.hunyuan15.vae import HunyuanVAEStream

            stream = HunyuanVAEStream(vae, RowSplit(pg, z.shape[3]) if rows else None)
            parts = []
            for k in chunks:
                parts.append(stream.decode(z[:, :, start:start + k]))
                start += k
        else:
            from longserve.engine.families.ltx2.vae import LTX2WindowedDecode

            window = LTX2WindowedDecode(vae, z, rows=RowSplit(pg, z.shape[3]) if rows else None)
            parts = []
            for k in chunks:
                parts.append(window.decode(start, start + k))
                start += k
    outs = [p for p in parts if p is not None]
    return torch.cat(outs, dim=2) if outs else None


def _split_on(ctx, name, z, chunks, workers):
    """On each sub-group of the first n ranks: the rows-split decode; rank 0's outputs by n."""
    vae, got = _vae(ctx, name), {}
    for n in workers:
        pg = _groups(ctx).get(n)
        if pg is not None:
            got[n] = _decode(name, vae, pg, z, chunks, rows=True)
    return got if ctx.pg.rank == 0 else None


def _latents(channels, frames, height=HEIGHT, width=WIDTH, batch=1, seed=1):
    return torch.randn(batch, channels, frames, height, width, generator=torch.Generator().manual_seed(seed))


CASES = {  # name: (latent channels, latent frames, chunks, batch)
    "tiny-wan": (None, 3, (2, 1), 2),
    "wan22": (None, 2, (1, 1), 1),
    "tiny-hunyuan15": (None, 3, (1, 2), 1),
    "tiny-ltx2": (None, 3, (2, 1), 1),
}


class _Ctx:
    def __init__(self):
        self.state = {}


@pytest.mark.parametrize("name", list(CASES))
def test_rows_split_at_1_to_4_workers_equals_the_one_worker_untiled_decode(bare_pool4, name):
    _, frames, chunks, batch = CASES[name]
    vae = _vae(_Ctx(), name)
    channels = vae.config.z_dim if name in ("tiny-wan", "wan22") else vae.config.latent_channels
    z = _latents(channels, frames, batch=batch)
    one = ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))
    want = _decode(name, vae, one, z, chunks, rows=False)
    assert want.std() > 0.05, "the reference should not be flat"
    got = bare_pool4.run(_split_on, name, z, chunks, WORKERS)[0]
    for n in WORKERS:
        assert got[n].shape == want.shape, n
        err = float((got[n] - want).abs().max())
        assert err <= ATOL, f"{name} on {n} workers differs by {err:.2e}"


def _without_halo(ctx, z):
    """tiny-wan on 2 ranks with a halo exchange that hands out zeros: the frame edge's padding, everywhere."""
    pg = _groups(ctx).get(2)
    if pg is None:
        return None
    vae = _vae(ctx, "tiny-wan")
    rows_class_pad = RowSplit.pad_rows

    def zeros_halo(self, x, p, mode="constant"):
        return torch.nn.functional.pad(x, [0, 0, p, p] + ([0, 0] if x.ndim == 5 else []), mode=mode)

    RowSplit.pad_rows = zeros_halo
    try:
        return _decode("tiny-wan", vae, pg, z, (1,), rows=True)
    finally:
        RowSplit.pad_rows = rows_class_pad


def test_a_band_without_its_halo_differs(bare_pool4):
    vae = _vae(_Ctx(), "tiny-wan")
    z = _latents(vae.config.z_dim, 1)
    one = ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))
    want = _decode("tiny-wan", vae, one, z, (1,), rows=False)
    got = bare_pool4.run(_without_halo, z)[0]
    assert float((got - want).abs().max()) > 1e-3


def test_bands_are_as_even_as_rows_allow_and_a_frame_needs_a_row_per_worker():
    assert row_bands(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_bands(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert row_bands(5, 1) == [(0, 5)]
    assert split_rows_fits(4, 4) and not split_rows_fits(3, 4)
    with pytest.raises(ValueError, match="3 latent rows into 4 bands"):
        row_bands(3, 4)

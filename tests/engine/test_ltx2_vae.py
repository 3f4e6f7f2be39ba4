"""LTX2WindowedDecode (engine/families/ltx2/vae.py) decodes tiny-ltx2's video VAE a window at a time, each window
with its halo, exactly as diffusers' one-call `vae.decode` of the whole clip, however the clip is cut (windows of one
latent frame, windows at the clip's first and last frames where the decoder pads with its own replicate rule, a window
longer than the halo); the halo derived from the modules is the decoder's receptive field in time: perturbing one
latent frame moves exactly the frames of the latent frames within H of it, and a halo one frame short differs."""

import pytest
import torch

from longserve.engine.families.ltx2.vae import LTX2WindowedDecode, halos, not_streamable
from longserve.weights import resolve_model

ATOL = 1e-5       # windowed and whole convolutions round differently
F = 20            # latent frames: 153 frames, longer than a window and its two halos (H = 7 on tiny-ltx2)


@pytest.fixture(scope="module")
def case():
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video.from_pretrained(str(resolve_model("tiny-ltx2")), subfolder="vae").eval()
    # 2x3 latents (the decoder's reflect padding needs 2): 64x96 pixels
    z = torch.randn(1, vae.config.latent_channels, F, 2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
    assert want.shape == (1, 3, 1 + 8 * (F - 1), 64, 96) and want.std() > 0.1, "the reference should not be flat"
    return vae, z, want


def test_the_halo_is_the_decoders_receptive_field_in_time(case):
    vae, z, want = case
    assert not_streamable(vae) is None
    before, after = halos(vae.decoder)
    # conv_in, 2 mid-block convs, the first upsampler's conv (1 each at the latent rate), 3 at 2x (1/2 each), 3 at
    # 4x, 4 at 8x, with the depth-to-space rounding: 7 latent frames either side
    assert (before, after) == (7, 7)
    j = 10
    bumped = z.clone()
    bumped[:, :, j] += 1
    with torch.no_grad():
        moved = (vae.decode(bumped, return_dict=False)[0] - want).abs().amax(dim=(0, 1, 3, 4)).nonzero().flatten()
    # latent frame i makes frames 8i - 7 .. 8i: the moved frames reach into those of latent frames j - 7 and j + 7
    assert ((int(moved.min()) + 7) // 8, (int(moved.max()) + 7) // 8) == (j - before, j + after)


@pytest.mark.parametrize("cuts", [(1, 6, 1, 12), (3, 9, 8), (F,)])
def test_windowed_decode_equals_diffusers_whole_decode(case, cuts):
    vae, z, want = case
    window, outs, start = LTX2WindowedDecode(vae, z), [], 0
    for k in cuts:
        outs.append(window.decode(start, start + k))
        assert outs[-1].shape[2] == (1 + 8 * (k - 1) if start == 0 else 8 * k)
        start += k
    got = torch.cat(outs, dim=2)
    err = float((got - want).abs().max())
    assert err <= ATOL, f"differs by {err:.2e}"
    # each window decodes its frames and up to 7 more on either side, no more
    assert window.decoded_latent_frames == sum(min(F, b + 7) - max(0, b - k - 7)
                                               for k, b in zip(cuts, torch.tensor(cuts).cumsum(0).tolist()))


def test_a_halo_one_frame_short_differs(case):
    vae, z, want = case
    window = LTX2WindowedDecode(vae, z, halo_frames=(6, 6))
    got = torch.cat([window.decode(0, 10), window.decode(10, F)], dim=2)
    assert float((got - want).abs().max()) > 1e-4


def test_a_vae_whose_windows_would_not_equal_its_whole_decode_is_refused_streaming(case):
    """Tiling (diffusers blends its own tiles over the clip) and a decoder that draws noise per call: the family
    then decodes the clip whole (`not_streamable` says why); the shipped tiny VAE streams."""
    vae, _, _ = case
    assert not_streamable(vae) is None
    vae.enable_tiling()
    try:
        assert "tiled" in not_streamable(vae)
    finally:
        vae.disable_tiling()
    from diffusers import AutoencoderKLLTX2Video

    noisy = AutoencoderKLLTX2Video.from_config({**vae.config, "decoder_inject_noise": [True] * len(
        vae.config.decoder_inject_noise)})
    assert "noise" in not_streamable(noisy)

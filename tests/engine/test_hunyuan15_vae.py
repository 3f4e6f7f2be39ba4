"""HunyuanVAEStream decodes tiny-hunyuan15's VAE chunk by chunk in time exactly as diffusers' `vae.decode` of the
whole clip (the decoder is causal in time: families/hunyuan15/vae.py), however the clip is cut (a first chunk of one
frame and of several; the one-chunk case is the pipeline's default path, tests/pipelines/test_hunyuan15_pipeline.py).
A stream that dropped its caches between chunks would differ at every chunk's start."""

import pytest
import torch

from longserve.engine.families.hunyuan15.vae import HunyuanVAEStream
from longserve.weights import resolve_model

ATOL = 1e-5       # chunked and whole convolutions round differently


@pytest.fixture(scope="module")
def case():
    from diffusers import AutoencoderKLHunyuanVideo15

    vae = AutoencoderKLHunyuanVideo15.from_pretrained(str(resolve_model("tiny-hunyuan15")), subfolder="vae").eval()
    # 5 latent frames of 3x5 latents (odd sizes): 17 frames of 48x80 pixels
    z = torch.randn(1, vae.config.latent_channels, 5, 3, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
    assert want.shape == (1, 3, 17, 48, 80) and want.std() > 0.1, "the reference should not be flat"
    return vae, z, want


@pytest.mark.parametrize("chunks", [(1, 1, 3), (2, 1, 2)])
def test_streamed_decode_equals_diffusers_whole_decode(case, chunks):
    vae, z, want = case
    stream, outs, start = HunyuanVAEStream(vae), [], 0
    for k in chunks:
        outs.append(stream.decode(z[:, :, start:start + k]))
        # the clip's first chunk makes 1 + 4(k - 1) frames, every later one 4k
        assert outs[-1].shape[2] == (1 + 4 * (k - 1) if start == 0 else 4 * k)
        start += k
    got = torch.cat(outs, dim=2)
    assert got.shape == want.shape
    err = float((got - want).abs().max())
    assert err <= ATOL, f"differs by {err:.2e}"
    assert stream.cache_bytes() > 0
    stream.close()
    assert stream.cache_bytes() == 0


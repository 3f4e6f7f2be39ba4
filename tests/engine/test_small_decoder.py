"""The live loop's decoders (engine/small_decoder.py, engine/families/causal_wan.py): TAEHV's decoder shape loaded
from its published state-dict format (widths, strides and patch read from the file), streamed chunk by chunk equal to
the whole video, refused at start naming `decoder` where it cannot decode the model's latents; the shipped tiny-live
decoder close to tiny-live's VAE; and the live family's VAE in bfloat16 on CUDA by default, a bf16 decode within bf16
rounding of the float32 one."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from longserve.engine.small_decoder import SmallDecoder, decoder_weights
from longserve.weights.registry import TINY_MODELS


def random_decoder(latent=16, widths=(32, 16, 16, 16), strides=(1, 2, 2), patch=1) -> SmallDecoder:
    torch.manual_seed(0)
    model = SmallDecoder(latent, widths, strides, patch)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    return model.eval()


def test_a_taehv_file_loads_by_its_shapes_and_chunks_decode_as_the_whole_video(tmp_path):
    from safetensors.torch import save_file

    model = random_decoder()
    sd = {k: v.half() for k, v in model.state_dict().items()}       # as the published .pth files: float16
    torch.save({**sd, "encoder.0.weight": torch.zeros(1)}, tmp_path / "taew.pth")   # an encoder half is skipped
    save_file(sd, str(tmp_path / "taew.safetensors"))
    for name in ("taew.pth", "taew.safetensors"):
        loaded = SmallDecoder.load(tmp_path / name)
        assert (loaded.latent_channels, loaded.widths, loaded.strides, loaded.patch) == (16, (32, 16, 16, 16),
                                                                                         (1, 2, 2), 1)
        assert (loaded.time_upscale, loaded.space_upscale) == (4, 8)
    z = torch.randn(1, 16, 5, 3, 4)
    with torch.no_grad():
        whole = model.decode(z, model.start())
        state = model.start()
        parts = [model.decode(z[:, :, a:b], state) for a, b in ((0, 1), (1, 3), (3, 5))]
    assert whole.shape == (1, 1 + 4 * 4, 3, 24, 32)                 # as Wan's VAE: 1 + 4 (n - 1) frames
    assert [p.shape[1] for p in parts] == [1, 8, 8]
    assert (torch.cat(parts, dim=1) - whole).abs().max() <= 1e-5          # conv sums reordered by batch size
    assert whole.std() > 0.01 and whole.min() >= 0 and whole.max() <= 1


def test_a_decoder_that_cannot_decode_the_model_s_latents_is_refused_at_start_naming_the_field(tmp_path,
                                                                                                monkeypatch):
    import longserve.engine.engine as engine_module
    from longserve.pipelines import VideoPipeline

    def no_workers(*args, **kwargs):
        raise AssertionError("the workers were started before the decoder was checked")

    monkeypatch.setattr(engine_module, "make_pool", no_workers)
    torch.save(random_decoder().state_dict(), tmp_path / "taew2_1.pth")       # Wan 2.1's 16 channels
    with pytest.raises(ValueError, match="decoder: the small decoder takes 16 latent channels; tiny-live's "
                                         "latents have 4"):
        VideoPipeline.from_pretrained("tiny-live", device="cpu", decoder=str(tmp_path / "taew2_1.pth"))
    torch.save(random_decoder(latent=4).state_dict(), tmp_path / "four.pth")   # 4x in time; tiny-live's VAE 1x
    with pytest.raises(ValueError, match="decoder: the small decoder upscales 4x in time"):
        VideoPipeline.from_pretrained("tiny-live", device="cpu", decoder=str(tmp_path / "four.pth"))
    with pytest.raises(ValueError, match="decoder: no small-decoder weights at"):
        VideoPipeline.from_pretrained("tiny-live", device="cpu", decoder=str(tmp_path / "missing.pth"))
    with pytest.raises(ValueError, match="decoder='tiny' is not available for 'tiny-wan'"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", decoder="tiny")
    with pytest.raises(ValueError, match="decoder='tiny': no small decoder ships for"):
        decoder_weights("tiny", TINY_MODELS["tiny-wan"])


def test_the_shipped_tiny_decoder_draws_what_tiny_live_s_vae_draws():
    """tiny-live's latents of a red ball then a blue one: the small decoder's frames within a few percent of the
    VAE's, streamed a chunk at a time, at a fraction of its multiply-adds."""
    from diffusers import AutoencoderKLWan

    from longserve.pipelines import VideoPipeline

    model = TINY_MODELS["tiny-live"]
    small = SmallDecoder.load(decoder_weights("tiny", model))
    assert decoder_weights("tiny", model).stat().st_size < 400_000
    with VideoPipeline.from_pretrained("tiny-live", workers=1) as pipe:
        z = torch.as_tensor(pipe("", seed=11, num_frames=24, output_type="latent", prompt_schedule=[
            [0, "a red ball bouncing"], [4, "a blue ball bouncing"]]).frames).float()
        with VideoPipeline.from_pretrained("tiny-live", workers=1, decoder="tiny") as tiny:
            frames = tiny("", seed=11, num_frames=24, prompt_schedule=[[0, "a red ball bouncing"],
                                                                       [4, "a blue ball bouncing"]]).frames
            with tiny.live("a red ball bouncing", seconds=1.0, seed=11) as session:   # a live session too
                first = np.asarray(next(iter(session)).frames)
    vae = AutoencoderKLWan.from_pretrained(model / "vae").eval()
    cfg = vae.config
    mean, std = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1), torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        want = (vae.decode(z * std + mean).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1)   # (1, T, H, W, 3)
        state = small.start()
        got = torch.cat([small.decode(z[:, :, c:c + 3], state) for c in range(0, 24, 3)], 1).permute(0, 1, 3, 4, 2)
    assert got.shape == want.shape == frames.shape
    # the engine's frames are the decoder's, through uint8 (the live loop's frames leave a worker as uint8)
    assert (torch.as_tensor(frames) - got).abs().max() <= 0.5 / 255 + 1e-6
    assert first.shape == (3, 64, 64, 3) and np.abs(first - np.asarray(frames[0, :3])).max() <= 1e-5
    assert (got - want).abs().mean() <= 0.03, (got - want).abs().mean()


def causal_family(vae_dtype, device):
    from longserve.engine.families.causal_wan import CausalWanFamily

    family = object.__new__(CausalWanFamily)
    family.config = types.SimpleNamespace(engine=types.SimpleNamespace(vae_dtype=vae_dtype))
    family.pg = types.SimpleNamespace(device=torch.device(device))
    family.dtype = torch.bfloat16
    return family


def test_the_live_vae_is_bfloat16_on_cuda_by_default_and_a_bf16_decode_stays_within_bf16_rounding():
    from diffusers import AutoencoderKLWan

    from longserve.engine.causal_vae import StreamingVAEDecoder
    from longserve.engine.dist import ParallelGroup

    assert causal_family(None, "cuda").component_dtypes()["vae"] == torch.bfloat16
    assert causal_family("float32", "cuda").component_dtypes()["vae"] == torch.float32
    assert causal_family(None, "cpu").component_dtypes()["vae"] == torch.float32
    solo = ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))
    z = torch.randn(1, 4, 6, 8, 8, generator=torch.Generator().manual_seed(0))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        vae = AutoencoderKLWan.from_pretrained(TINY_MODELS["tiny-live"] / "vae", torch_dtype=dtype).eval()
        decoder = StreamingVAEDecoder(vae, solo, 1, 8, 8)
        with torch.no_grad():
            out[dtype] = torch.cat([decoder.decode(z[:, :, c:c + 3].to(dtype)) for c in (0, 3)], 2).float()
        decoder.close()
    diff = (out[torch.bfloat16] - out[torch.float32]).abs()
    assert out[torch.float32].std() > 0.1
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9): a few roundings deep, in [-1, 1] pixels
    assert diff.mean() <= 4 * 2 ** -9 and diff.max() <= 32 * 2 ** -9, (diff.mean(), diff.max())

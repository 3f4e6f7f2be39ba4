"""CFG truncation (`cfg_trunc_ratio`, diffusers' Lumina2Pipeline semantics): step i of N runs the unconditional
branch only while (i + 1) / N <= ratio. Off (no option, or 1.0) is the exact output; on, tiny-wan's frames equal a
hand-written denoising loop that skips the unconditional forward on the last steps."""

import numpy as np
import pytest
import torch

from longserve.engine.request import RequestError
from longserve.weights import resolve_model

ATOL = 1e-4
PROMPT, NEGATIVE = "a red ball bouncing", "blurry, low quality"
REQUEST = dict(num_frames=5, height=48, width=64, num_inference_steps=4, guidance_scale=5.0, seed=3)


def reference_loop(ratio: float) -> np.ndarray:
    """WanPipeline's loop by hand, with the unconditional forward only on steps (i + 1) / N <= ratio."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(resolve_model("tiny-wan")))
    n, scale = REQUEST["num_inference_steps"], REQUEST["guidance_scale"]
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(PROMPT, NEGATIVE, do_classifier_free_guidance=True, device="cpu",
                                         max_sequence_length=512)       # WanPipeline.__call__'s
        pipe.scheduler.set_timesteps(n, device="cpu")
        latents = pipe.prepare_latents(1, pipe.transformer.config.in_channels, REQUEST["height"], REQUEST["width"],
                                       REQUEST["num_frames"], torch.float32, "cpu",
                                       torch.Generator("cpu").manual_seed(REQUEST["seed"]))
        def forward(x, t, text):
            return pipe.transformer(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=text,
                                    return_dict=False)[0]

        for i, t in enumerate(pipe.scheduler.timesteps):
            pred = forward(latents, t, cond)
            if (i + 1) / n <= ratio:
                u = forward(latents, t, uncond)
                pred = u + scale * (pred - u)
            latents = pipe.scheduler.step(pred, t, latents, return_dict=False)[0]
        z = pipe.vae.config.z_dim
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
        video = pipe.vae.decode(latents * std + mean, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type="np")


def test_cfg_truncation_off_is_exact_and_on_equals_the_hand_written_loop(pipeline):
    wan = pipeline("tiny-wan")
    exact = wan(PROMPT, negative_prompt=NEGATIVE, **REQUEST).frames
    off = wan(PROMPT, negative_prompt=NEGATIVE, cfg_trunc_ratio=1.0, **REQUEST).frames
    assert np.array_equal(off, exact)
    truncated = wan(PROMPT, negative_prompt=NEGATIVE, cfg_trunc_ratio=0.5, **REQUEST).frames   # steps 2, 3: cond only
    want = reference_loop(0.5)
    assert np.abs(truncated - want).max() <= ATOL
    assert np.abs(truncated - exact).max() > 1e-3, "skipping the unconditional branch should change the video"
    assert np.abs(reference_loop(1.0) - exact).max() <= ATOL


def test_cfg_trunc_ratio_outside_0_1_is_refused_naming_it(pipeline):
    with pytest.raises(RequestError, match="cfg_trunc_ratio"):
        pipeline("tiny-wan")(PROMPT, cfg_trunc_ratio=1.5, **REQUEST)

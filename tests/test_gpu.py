"""GPU paths: NCCL, one GPU per worker, bf16, xformers / SDPA. Skipped cleanly without CUDA."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = "a red ball bouncing"
KW = dict(num_frames=13, height=80, width=112, num_inference_steps=3, guidance_scale=4.5, seed=3)


@pytest.fixture(scope="module")
def cpu_frames():
    from pipelines import VideoPipeline

    with VideoPipeline.from_pretrained("tiny-latte", workers=1, device="cpu") as pipe:
        return pipe(PROMPT, **KW).frames


def test_one_gpu_fp32_matches_cpu(cpu_frames):
    from pipelines import VideoPipeline

    with VideoPipeline.from_pretrained("tiny-latte", workers=1, device="cuda", attention="sdpa") as pipe:
        assert pipe.info["device"].startswith("cuda")
        got = pipe(PROMPT, **KW).frames
    # TF32 matmuls and different kernels: close, not bitwise
    assert np.abs(got - cpu_frames).max() <= 2e-2


@pytest.mark.parametrize("family", ["latte", "wan"])
def test_one_gpu_bf16_forward_is_no_further_from_fp32_than_diffusers_own_bf16(family):
    """tests/test_bf16.py's comparison, on the GPU (its SDPA kernels; TF32 off for the fp32 reference)."""
    from test_bf16 import bf16_relative_errors

    torch.backends.cuda.matmul.allow_tf32 = False
    mine, theirs = bf16_relative_errors(family, "cuda")
    assert mine <= 1.25 * theirs, f"ours {mine:.2e} vs diffusers' bf16 {theirs:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL, one GPU per worker)")
@pytest.mark.parametrize("parallel", ["dsp", "ulysses", "ring", "megatron-sp"])
def test_nccl_workers_match_one_gpu(parallel):
    from pipelines import VideoPipeline

    n = min(torch.cuda.device_count(), 4)
    with VideoPipeline.from_pretrained("tiny-latte", workers=1, device="cuda", attention="sdpa") as pipe:
        want = pipe(PROMPT, **KW).frames
    with VideoPipeline.from_pretrained("tiny-latte", workers=n, device="cuda", parallel=parallel,
                                       attention="sdpa") as pipe:
        got = pipe(PROMPT, **KW).frames
    assert np.abs(got - want).max() <= 1e-3


def test_xformers_is_used_when_installed():
    pytest.importorskip("xformers")
    from pipelines import VideoPipeline

    with VideoPipeline.from_pretrained("tiny-latte", workers=1, device="cuda") as pipe:
        assert pipe.info["attention"] == "xformers"
        assert pipe(PROMPT, **KW).frames.shape == (1, 13, 80, 112, 3)

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
    """tests/test_bf16.py's comparison, on the GPU (SDPA flash / efficient kernels, TF32 off for the fp32 reference)."""
    from test_bf16 import SOLO, bf16, relative_error

    from engine.families import latte, wan
    from engine.parallel import make_sequence_parallel
    from latte_models import latte_inputs, tiny_latte_transformer
    from server.bench.models import random_wan_transformer

    torch.backends.cuda.matmul.allow_tf32 = False
    solo = type(SOLO)(rank=0, world_size=1, device=torch.device("cuda"))
    if family == "latte":
        model = tiny_latte_transformer(heads=3, video_length=9).cuda()
        inputs = [t.cuda() for t in latte_inputs(batch=2, frames=9, grid_h=3, grid_w=5, seed=3)]
        reference = lambda m, x, t, e: m(x, timestep=t, encoder_hidden_states=e).sample  # noqa: E731
        ours = lambda m, x, t, e: latte.parallel_forward(m, x, t, e, solo, "dsp")  # noqa: E731
    else:
        model = random_wan_transformer(heads=3).cuda()
        g = torch.Generator().manual_seed(3)
        inputs = [t.cuda() for t in (torch.randn(2, 4, 5, 10, 14, generator=g), torch.tensor([900.0, 300.0]),
                                     torch.randn(2, 6, 16, generator=g))]
        reference = lambda m, x, t, e: m(x, t, e, return_dict=False)[0]  # noqa: E731
        sp = make_sequence_parallel(solo, "ulysses")
        ours = lambda m, x, t, e: wan.parallel_forward(m, x, t, e, sp)  # noqa: E731
    with torch.no_grad():
        want = reference(model, *inputs)
        model = model.to(torch.bfloat16)
        theirs = relative_error(reference(model, *bf16(*inputs)), want)
        mine = relative_error(ours(model, *bf16(*inputs)), want)
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

"""bf16 numerics shared by the CPU test (tests/engine/test_bf16.py) and its GPU twin (tests/engine/test_gpu.py): our
forward in bf16 against diffusers' fp32 forward, beside diffusers' own bf16 forward."""

import torch
from latte_models import latte_inputs, tiny_latte_transformer

from longserve.engine.dist import ParallelGroup
from longserve.engine.models import latte
from longserve.engine.models.wan import WanSequenceParallel
from longserve.engine.parallel import make_sequence_parallel
from tools.bench.models import random_wan_transformer


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().mean() / want.abs().mean()).item()


def bf16(*tensors):
    return [t.to(torch.bfloat16) if t.is_floating_point() else t for t in tensors]


def bf16_relative_errors(family: str, device: str = "cpu") -> tuple[float, float]:
    """(ours, diffusers') relative error of a bf16 forward against diffusers' fp32 forward on the same inputs."""
    solo = ParallelGroup(rank=0, world_size=1, device=torch.device(device))
    if family == "latte":
        model = tiny_latte_transformer(heads=3, video_length=9)
        inputs = latte_inputs(batch=2, frames=9, grid_h=3, grid_w=5, seed=3)
        reference = lambda m, x, t, e: m(x, timestep=t, encoder_hidden_states=e).sample  # noqa: E731
        ours = lambda m, x, t, e: latte.parallel_forward(m, x, t, e, solo, "dsp")  # noqa: E731
    else:
        model = random_wan_transformer(heads=3)
        g = torch.Generator().manual_seed(3)
        inputs = (torch.randn(2, 4, 5, 10, 14, generator=g), torch.tensor([900.0, 300.0]),
                  torch.randn(2, 6, 16, generator=g))
        reference = lambda m, x, t, e: m(x, t, e, return_dict=False)[0]  # noqa: E731
        sp = make_sequence_parallel(solo, "ulysses")
        ours = lambda m, x, t, e: WanSequenceParallel(m)(x, t, e, sp)  # noqa: E731
    model, inputs = model.to(device), [t.to(device) for t in inputs]
    with torch.no_grad():
        want = reference(model, *inputs)
        model = model.to(torch.bfloat16)
        theirs = relative_error(reference(model, *bf16(*inputs)), want)
        mine = relative_error(ours(model, *bf16(*inputs)), want)
    return mine, theirs

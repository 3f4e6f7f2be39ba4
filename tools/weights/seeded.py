"""Seeded random weights for any module: what the tiny checkpoints' builders draw (`tools/weights/`) and what
`longserve bench` draws for its random models of a published shape.

Every parameter is redrawn from a generator seeded by the caller, in sorted-name order, so the weights depend
only on the parameter names, their shapes and the seed: not on torch's default initialisers, nor on the global
RNG. On one machine the same seed gives the same bits (the shipped checkpoints are rebuilt byte for byte from
their builders); torch's kernels differ by CPU (`ATEN_CPU_CAPABILITY`), so across machines the draws agree to
float rounding (tests/support/checkpoints.py).

Nothing here imports torch at module level.
"""

from __future__ import annotations

import math


def _std_for(t) -> float:
    fan_in = t[0].numel() if t.dim() >= 2 else t.numel()
    return min(0.2, max(0.02, 1.0 / math.sqrt(max(fan_in, 1))))


def reinit_(module, seed: int, device=None):
    """Redraw every parameter of ``module`` from a generator seeded with ``seed``; returns ``module``.

    ``device``: where the generator draws (default the CPU, what the shipped checkpoints are built from); the
    benches draw a many-GB model on its GPU instead (other numbers than the CPU's, the same on every rank).

    Matrices/convolutions get N(0, clamp(1/sqrt(fan_in), 0.02, 0.2)); 1-D norm scales get 1 + N(0, 0.05);
    other vectors (biases) get N(0, 0.05); ``scale_shift_table`` gets N(0, 0.1). Every weight, the ones
    diffusers initialises to zero included (proj_out, adaLN), so an output is O(1) and depends on all of them.
    """
    import torch

    gen = torch.Generator(device=device or "cpu").manual_seed(seed)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            leaf = name.rsplit(".", 1)[-1]
            is_norm_scale = p.dim() == 1 and leaf == "weight"
            if name.endswith("scale_shift_table"):
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=gen.device) * 0.1
            elif p.dim() >= 2:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=gen.device) * _std_for(p)
            elif is_norm_scale:
                noise = 1.0 + torch.randn(p.shape, generator=gen, dtype=torch.float32, device=gen.device) * 0.05
            else:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=gen.device) * 0.05
            p.copy_(noise.to(p.dtype))
    return module


def redraw_(module, seed: int):
    """``reinit_``, then the Wan VAE's RMS-norm gains around 1; returns ``module``.

    AutoencoderKLWan stores its norm gains as ``gamma`` tensors of shape (C, 1, 1[, 1]), which ``reinit_``
    would treat as 1x1 kernels and draw around 0, silencing every block.
    """
    import torch

    reinit_(module, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 7919)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            if name.endswith("gamma"):
                p = params[name]
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.05)
    return module

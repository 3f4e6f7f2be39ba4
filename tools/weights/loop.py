"""The optimisation loop the tiny-model trainers share: AdamW with warm-up and cosine decay, gradient clipping and
an exponential moving average of the weights, which the model holds at the end.

Each trainer gives its own loss (`step_loss(step) -> (loss to minimise, {name: value to record})`); the order of
the operations (learning rate, loss, backward, clip, step, EMA) is fixed here, so a seeded run gives the same
weights whichever trainer calls it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

StepLoss = Callable[[int], tuple[torch.Tensor, dict[str, float]]]


def cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to 5% of it at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_with_ema(model, step_loss: StepLoss, steps: int, *, lr: float, warmup: int, weight_decay: float,
                   ema_decay: float, log=print, log_every: int = 25, name: str = "transformer",
                   on_step: Callable[[int, dict], None] | None = None) -> dict[str, list[float]]:
    """Train `model` for `steps` steps of `step_loss`; return the recorded values, one list per name.

    The learning rate warms up linearly for min(warmup, steps // 10 + 1) steps to `lr`, then decays on a cosine to
    5% of it; gradients are clipped to norm 1; the EMA decay is min(ema_decay, (1 + step) / (10 + step)), and the
    model is left in eval mode holding the EMA weights (integer buffers are copied, not averaged).
    `on_step(steps_done, ema_state)`, when given, is called after every step."""
    model.train()
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)
    records: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, min(warmup, steps // 10 + 1))
        loss, values = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if v.is_floating_point():
                    ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
                else:
                    ema[k].copy_(v)
        for key, value in values.items():
            records.setdefault(key, []).append(value)
        if on_step is not None:
            on_step(step + 1, ema)
        if step % log_every == 0 or step == steps - 1:
            shown = ", ".join(f"{key} {np.mean(vals[-50:]):.4f}" for key, vals in records.items())
            log(f"{name} {step + 1}/{steps}: {shown}, {time.perf_counter() - t0:.0f} s")
    model.load_state_dict(ema)
    model.eval()
    return records

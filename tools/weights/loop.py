"""The optimisation loop the tiny-model trainers share: AdamW with warm-up and cosine decay, gradient clipping and
an exponential moving average of the weights, which the model holds at the end.

Each trainer gives its own loss (`step_loss(step) -> (loss to minimise, {name: value to record})`); the order of
the operations (learning rate, loss, backward, clip, step, EMA) is fixed here, so a seeded run gives the same
weights whichever trainer calls it. `training_main` is the command line of the trainers that take the same
options (seed, steps, clips per prompt, learning rate, threads).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

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


def training_main(argv: list[str] | None, *, module: str, doc: str, train: Callable, default_out: Path, seed: int,
                  steps: int, clips_per_prompt: int, lr: float, threads: int) -> int:
    """`python -m tools.weights.<module>`: train into --out; the run's record and loss plot go beside it, or into
    weights/ as `<module>.json` and `<module>-loss.png` for the shipped checkpoint (`default_out`)."""
    ap = argparse.ArgumentParser(prog=f"python -m tools.weights.{module}", description=doc.split("\n")[0])
    ap.add_argument("--out", default=str(default_out), help=f"output directory (default: {default_out})")
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--steps", type=int, default=steps, help="transformer steps")
    ap.add_argument("--clips-per-prompt", type=int, default=clips_per_prompt)
    ap.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    ap.add_argument("--threads", type=int, default=threads, help="torch CPU threads (results depend on it)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    stem = default_out.parent / module if out == default_out else out.parent / out.name
    train(out, seed=args.seed, steps=args.steps, clips_per_prompt=args.clips_per_prompt, threads=args.threads,
          lr=args.lr, record_path=Path(f"{stem}.json"), plot=Path(f"{stem}-loss.png"),
          log=lambda msg: print(msg, flush=True))
    return 0

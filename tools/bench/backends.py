"""`longserve bench gpu --sections backends`: one Wan 2.1 1.3B-shaped denoising step per attention backend.

The step is the engine's own at one worker (`engine.models.wan.WanSequenceParallel`, bf16, the CFG batch of 2, 81
frames at 480x832: 32,760 tokens, the full 30 blocks), with `attention_backend` set as an engine sets it (diffusers'
`set_attention_backend` on the transformer, and the sequence-parallel group's backend for our self-attention).
Each backend is first checked as an engine start checks it (`engine.attention`: installed, and one probe on this
device in bf16); one that cannot run is a row with its reason, not a failure. Rows: the median step time over
--repeats (after one warm-up), its ratio to the default (no backend set: PyTorch SDPA), and the relative error of
its output against the default's (mean |x - ref| / mean |ref|: SageAttention quantises, flash reorders sums).
The default is timed first and again last, so the spread of the two says how far apart two rows must be to differ.
"""

from __future__ import annotations

import statistics

#: what the section times, after the default: diffusers' names (AttentionBackendName)
BACKENDS = ("native", "flash", "_flash_3", "sage", "_native_flash", "_native_efficient", "_native_cudnn", "xformers")


def usable(name: str, dev) -> str | None:
    """None when `name` runs on `dev` in bf16 as an engine would check it, else why not."""
    import torch

    from longserve.engine.attention import check_installed, check_name, probe

    try:
        check_name(name)
        check_installed(name)
        probe(name, dev, torch.bfloat16)
    except ValueError as e:
        return str(e)
    return None


def backends(args, out, dev) -> None:
    import torch

    from longserve.engine.attention import keeping_active_backend
    from longserve.engine.models.wan import WanSequenceParallel
    from longserve.engine.parallel import make_sequence_parallel
    from tools.bench.gpu_models import build_wan, free, solo_group, time_call, wan_config, wan_inputs

    s = args.smoke
    size = "81 frames 480x832" if not s else "smoke"
    cfg = wan_config(s)
    model = build_wan(cfg).to(dev, torch.bfloat16)
    hooked = WanSequenceParallel(model)
    x, t, e = wan_inputs(cfg, 21 if not s else 3, 60 if not s else 6, 104 if not s else 10, dev, torch.bfloat16,
                         text_len=8 if s else 512)
    solo = solo_group(dev)

    def timed(backend: str | None):
        sp = make_sequence_parallel(solo, "ulysses", attention_backend=backend)
        with torch.no_grad():
            result = hooked(x, t, e, sp)                                   # the warm-up, and the output compared
            times = [time_call(dev, hooked, x, t, e, sp) for _ in range(args.repeats)]
        return statistics.median(times), result.float()

    base_s, base = timed(None)
    out.row(section="backends", model="wan2.1-1.3b", size=size, backend="default", step_s=base_s,
            repeats=args.repeats)
    with keeping_active_backend():        # the section's sets also set the process's backend: put back
        for name in BACKENDS:
            if out.over_budget():
                out.row(section="backends", backend=name, skipped="over --budget-s")
                continue
            why = usable(name, dev)
            if why is not None:
                out.row(section="backends", model="wan2.1-1.3b", size=size, backend=name, skipped=why[:240])
                continue
            try:
                model.set_attention_backend(name)
                step_s, got = timed(name)
            except Exception as err:  # noqa: BLE001 - a backend that cannot run these shapes is a finding
                out.row(section="backends", model="wan2.1-1.3b", size=size, backend=name,
                        error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                free(dev)
                continue
            rel = ((got - base).abs().mean() / base.abs().mean()).item()
            out.row(section="backends", model="wan2.1-1.3b", size=size, backend=name, step_s=step_s,
                    vs_default=step_s / base_s, rel_err=rel, repeats=args.repeats)
            del got
    model.reset_attention_backend()              # diffusers' default again, for the second default row
    again_s, _ = timed(None)
    out.row(section="backends", model="wan2.1-1.3b", size=size, backend="default (again)", step_s=again_s,
            vs_default=again_s / base_s, repeats=args.repeats)
    model = hooked = x = e = base = None       # the memory back before the next section
    free(dev)

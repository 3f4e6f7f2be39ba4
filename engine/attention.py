"""`attention_backend`: which of diffusers' attention-dispatcher backends runs a model's attention.

diffusers routes every attention of its newer models through `dispatch_attention_fn`, which picks a kernel by
name (`AttentionBackendName`: "native" PyTorch SDPA, "flash" flash-attn 2, "_flash_3" flash-attn 3, "sage"
SageAttention, "_native_cudnn", "_native_efficient", ...). An engine names one (`EngineConfig.attention_backend`);
it is set on the loaded transformers with diffusers' `set_attention_backend` (their own processors: cross-attention,
LTX-2's cross-modal attentions, ...) and is what longserve's own attention calls run (`attend`: the local attention
of the Ulysses plan and of one worker, HunyuanVideo-1.5's joint attention). None, the default, changes nothing:
diffusers' default and PyTorch SDPA, as before the option existed.

A backend is checked before any weight loads (`check_backend` in the coordinator, `probe` on each worker's
device): its name, its package (diffusers' own requirement check, through its `attention_backend` context
manager), and one tiny attention on the device in the engine's dtype (with a mask where the family's attention
takes one), so that a kernel that cannot run there (flash on a CPU, flash with float32, a mask on flash) is
refused at start with the kernel's own reason, naming the field. Where longserve merges partial attentions
itself (Ring and USP's ring, LTX-2's video->audio attention across workers) the dispatcher's kernels do not
run (they would have to return a log-sum-exp, which "native" does not), so a backend other than "native" is
refused there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FIELD = "attention_backend"


def names() -> tuple[str, ...]:
    """Every backend name the installed diffusers' dispatcher knows."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return tuple(b.value for b in AttentionBackendName)


def check_name(name) -> str | None:
    """None (or "none": a config file's or a flag's way to say unset), or a known backend's name (lower case) -> the
    name; ValueError naming the field otherwise."""
    if name is None or (isinstance(name, str) and name.strip().lower() == "none"):
        return None
    if not isinstance(name, str) or name.strip().lower() not in names():
        raise ValueError(f"{FIELD} must be one of {', '.join(names())} (diffusers' AttentionBackendName) or none "
                         f"(unset); got {name!r}")
    name = name.strip().lower()
    if name.endswith("_hub"):
        raise ValueError(f"{FIELD}={name!r} downloads its kernel from the Hugging Face Hub when it starts, and "
                         f"longserve downloads nothing at run time; install the kernel's package and name the "
                         f"backend without _hub")
    return name


def check_installed(name: str) -> None:
    """diffusers' own check that the backend's package is installed (and new enough)."""
    from diffusers.models.attention_dispatch import attention_backend

    try:
        with attention_backend(name):
            pass
    except (RuntimeError, ValueError, ImportError) as e:
        raise ValueError(f"{FIELD}={name!r} is not usable here: {_first_line(e)}") from None


def head_dims(model_dir) -> tuple[int, ...]:
    """The head widths of a checkpoint's transformer (`*attention_head_dim` in its config: LTX-2 has one for its
    audio stream too), or (64,) when its config does not say."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "transformer" / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return (64,)
    dims = {v for k, v in config.items() if k.endswith("attention_head_dim") and isinstance(v, int) and v > 0}
    return tuple(sorted(dims)) or (64,)


def probe(name: str, device, dtype: torch.dtype, masked: bool = False, dims: tuple[int, ...] = (64,)) -> None:
    """One tiny attention through the backend on `device` in `dtype` per head width in `dims` (with a boolean key
    mask when `masked`); ValueError naming the field with the kernel's reason when it does not run."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    device = torch.device(device)
    for hd in dims:
        q = torch.randn(1, 8, 2, hd, device=device, dtype=dtype)                  # (B, S, H, hd)
        mask = torch.ones(1, 1, 1, 8, device=device, dtype=torch.bool) if masked else None
        try:
            out = dispatch_attention_fn(q, q, q, attn_mask=mask, backend=name)
        except Exception as e:         # noqa: BLE001 (any failure of the kernel is a refusal, in its own words)
            needs = " with an attention mask (this model's attention takes one)" if masked else ""
            raise ValueError(f"{FIELD}={name!r} does not run on {device.type} with dtype "
                             f"{str(dtype).replace('torch.', '')} and heads {hd} wide{needs}: "
                             f"{_first_line(e)}") from None
        if out.shape != q.shape:
            raise ValueError(f"{FIELD}={name!r} returned {tuple(out.shape)} for {tuple(q.shape)}")


def check_backend(config, family, plan, device: str, model_dir=None) -> None:
    """The coordinator's checks, before any worker starts: the family runs diffusers' dispatcher, the plan does
    not merge attention itself, the package is installed, and on a CPU engine the backend runs (a CUDA engine's
    workers probe their own device before loading weights: `probe`)."""
    name = config.attention_backend
    if name is None:
        return
    check_plan(name, family, plan, config.workers)
    check_installed(name)
    if device == "cpu":
        from longserve.engine.dist import parse_dtype

        probe(name, "cpu", parse_dtype(config.dtype), masked=family.attention_masks,
              dims=head_dims(model_dir) if model_dir is not None else (64,))


def check_plan(name: str | None, family, plan, workers: int) -> None:
    """The backend suits the family and the plan (also when the plan changes on a running engine)."""
    if name is None or name == "native":
        return                  # native: what every family and plan already runs (Ring: our merged matmuls)
    if not family.dispatcher_attention:
        raise ValueError(f"{FIELD}={name!r} is not available for the {family.name} family: "
                         f"{family.dispatcher_attention_note}")
    merged = _merging_plan(family, plan, workers)
    if merged:
        raise ValueError(f"{FIELD}={name!r} cannot run with {merged}: longserve merges those partial attentions "
                         f"itself with a log-sum-exp (diffusers' kernels run only the local attention); use "
                         f"parallel=ulysses, or attention_backend=native")


def _merging_plan(family, plan, workers: int) -> str | None:
    """What of `plan` on `workers` merges attention across workers (None when nothing does)."""
    group = workers // 2 if plan.cfg_parallel and workers > 1 else workers      # one CFG half's sequence group
    ring = group // (plan.ulysses_degree or group) if plan.name == "usp" else group if plan.name == "ring" else 1
    if ring > 1:
        return f"parallel={plan.name!r} over {group} workers (its ring passes)"
    if family.merges_across_workers and group > 1:
        return f"{group} sequence-parallel workers ({family.merges_across_workers})"
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, backend: str | None = None,
           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of (B, H, Lq, hd) queries over (B, H, Lk, hd) keys -> (B, H, Lq, hd): PyTorch SDPA when `backend`
    is None (exactly the call longserve made before the option existed), else diffusers' dispatcher."""
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    out = dispatch_attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                                scale=scale, backend=backend)
    return out.transpose(1, 2)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]

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

Sparse attention for long videos (`RadialMask`, `radial_attention`): radial attention's static mask (Li et al.,
2025, "Radial Attention: O(n log n) sparse attention with energy decay"), training-free. Tokens are frame-major
(`frame_tokens` per latent frame); a query sees every key of the frames within `dense_frames` of its own, and in a
frame d > dense_frames away only the keys within T / 2^(floor(log2 d) + 1) of its own position in the frame (the
window halves each time the distance doubles, down to the key at its own position, which stays visible at every
distance). Each band of distances [2^k, 2^(k+1)) then holds about T keys: a query sees O(T log F) keys of the T F,
not all of them. On CUDA the mask runs as a FlexAttention block mask (blocks that are all masked are skipped: the
speed); elsewhere, and as the reference, as SDPA with the boolean mask. Off (no mask) is the dense attention as it was.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

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


@contextmanager
def keeping_active_backend():
    """diffusers' `ModelMixin.set_attention_backend` also makes its backend the process-wide active one (what every
    model whose processors name none dispatches to), and `reset_attention_backend` leaves that as it is: in a
    process that sets a backend on one model and then runs others (a bench, a test process), the others ran the last
    backend set. Inside this, set what you like; on leaving, the process's active backend is the one it was."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    try:
        yield
    finally:
        _AttentionBackendRegistry.set_active_backend(before)


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


# -- radial attention's static sparse mask ------------------------------------------------------------------------


@dataclass(frozen=True)
class RadialMask:
    """Radial attention's mask over `frames` x `frame_tokens` tokens, frame-major (the module docstring)."""

    frames: int
    frame_tokens: int
    dense_frames: int = 1          # frames on either side a query sees whole (its own always)

    def __post_init__(self):
        for name in ("frames", "frame_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.dense_frames, int) or self.dense_frames < 0:
            raise ValueError(f"dense_frames must be a non-negative integer, got {self.dense_frames!r}")

    @property
    def tokens(self) -> int:
        return self.frames * self.frame_tokens

    def window(self, distance: torch.Tensor) -> torch.Tensor:
        """Half-width of the visible window in a frame `distance` frames away (distance > dense_frames)."""
        band = torch.floor(torch.log2(distance.clamp(min=1).float()))          # k: 2^k <= d < 2^(k+1)
        return torch.floor(self.frame_tokens / torch.exp2(band + 1))

    def visible(self, q_start: int, q_len: int, k_start: int, k_len: int, device=None) -> torch.Tensor:
        """(q_len, k_len) bool, True = attend: queries at tokens [q_start, q_start + q_len), keys at [k_start, ...)
        (the protocol of engine.parallel.BlockCausal, for attention over parts of the sequence)."""
        q = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        k = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        return self._rule(q, k)

    def _rule(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        T = self.frame_tokens
        distance = (q // T - k // T).abs()
        offset = (q % T - k % T).abs()
        return (distance <= self.dense_frames) | (offset <= self.window(distance))

    def dense(self, device=None) -> torch.Tensor:
        """The whole (S, S) mask (for the reference and small sequences)."""
        return self.visible(0, self.tokens, 0, self.tokens, device)

    def density(self) -> float:
        """The fraction of (query, key) pairs attended."""
        return float(self.dense().float().mean())

    def flex_block_mask(self, device, block: int = 128):
        """FlexAttention's BlockMask of this mask (blocks of `block` tokens that are all masked are skipped)."""
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return self._rule(q_idx, kv_idx)

        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=self.tokens, KV_LEN=self.tokens, device=device,
                                 BLOCK_SIZE=block)


def radial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: RadialMask | None,
                     scale: float | None = None, flex: bool | None = None) -> torch.Tensor:
    """Attention of (B, H, S, hd) queries over (B, H, S, hd) keys with radial attention's mask -> (B, H, S, hd); the
    dense attention (PyTorch SDPA) when `mask` is None. `flex`: run FlexAttention's block-sparse kernel (default: on
    CUDA), else SDPA with the boolean mask (the same result within float rounding)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if q.shape[2] != mask.tokens or k.shape[2] != mask.tokens:
        raise ValueError(f"the radial mask covers {mask.frames} x {mask.frame_tokens} = {mask.tokens} tokens; got "
                         f"{q.shape[2]} queries and {k.shape[2]} keys")
    if flex is None:
        flex = q.is_cuda
    if flex:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask.flex_block_mask(q.device), scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device), scale=scale)


def radial_keys_per_query(frames: int, frame_tokens: int, dense_frames: int = 1) -> float:
    """The mean keys a query sees (what the mask saves over T F), computed from the rule, not materialised."""
    T, total = frame_tokens, 0
    for d in range(-(frames - 1), frames):
        pairs = frames - abs(d)                      # frame pairs at this signed distance
        if abs(d) <= dense_frames:
            total += pairs * T * T
        else:
            w = T // 2 ** (int(math.log2(abs(d))) + 1)
            total += pairs * sum(min(T - 1, s + w) - max(0, s - w) + 1 for s in range(T))
    return total / (frames * T)

"""Counting a worker's model work independently of the machine: transformer forwards and attention token pairs.

`WorkCounter` (a context manager, entered for the jobs that follow, like engine.memory.PeakMemory) counts

- transformer forwards: calls of any module whose class name ends in ``Transformer3DModel`` (diffusers' video
  transformers), times the batch of the call (classifier-free guidance's two halves are two forwards), read from
  its first positional tensor or, when it is called with keywords only, from the first module it calls;
- attention token pairs: for every ``F.scaled_dot_product_attention`` call, batch x query tokens x the key tokens
  each query may attend (a boolean mask's True entries, an additive mask's finite ones; all keys without a
  mask), split by whether it runs inside a cross-attention module (diffusers' ``is_cross_attention``, or a
  module named ``attn2``) or not (self-attention). Heads are not counted: a pair is one query token and one
  key token in one layer.

On a dispatch-bound tiny model the wall time hides differences in work that a GPU-sized model shows; these
counts do not depend on the machine, the thread count or the load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _is_transformer(module) -> bool:
    return type(module).__name__.endswith("Transformer3DModel")


def _is_cross(module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or getattr(module, "_workcount_cross", False)


def attended_pairs(q: torch.Tensor, k: torch.Tensor, attn_mask=None, is_causal: bool = False) -> int:
    """Query x key token pairs one SDPA call attends, per head: q (..., H, Lq, D), k (..., H, Lk, D)."""
    lq, lk = q.shape[-2], k.shape[-2]
    leading = q.shape[:-3] if q.dim() >= 4 else ()
    batch = int(torch.tensor(leading).prod()) if leading else 1
    if attn_mask is not None:
        shape = (*q.shape[:-2], lq, lk)
        heads = q.shape[-3] if q.dim() >= 3 else 1
        mask = attn_mask if attn_mask.dtype == torch.bool else torch.isfinite(attn_mask)
        return int(mask.expand(shape).sum()) // heads
    if is_causal:
        return batch * sum(min(lk, i + 1 + lk - lq) for i in range(lq))
    return batch * lq * lk


class WorkCounter(TorchFunctionMode):
    """Counts forwards and attention pairs while entered (see the module doc); `counts()` reads them."""

    def __init__(self):
        super().__init__()
        self.forwards = 0
        self.self_pairs = 0
        self.cross_pairs = 0
        self._cross_depth = 0
        self._pending = False      # a transformer called with keyword arguments only: its batch from the next module
        self._hooks = []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 else None
            if _is_transformer(module):
                self._pending = True
            if self._pending and tensor is not None:      # the transformer's input, or its patch embedding's
                self.forwards += int(tensor.shape[0])
                self._pending = False
            if _is_cross(module):
                self._cross_depth += 1

        def post(module, args, output):
            if _is_cross(module):
                self._cross_depth -= 1

        self._hooks = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            pairs = attended_pairs(q, k, mask, bool(kwargs.get("is_causal", False)))
            if self._cross_depth > 0:
                self.cross_pairs += pairs
            else:
                self.self_pairs += pairs
        return func(*args, **kwargs)

    def counts(self) -> dict:
        return {"forwards": self.forwards, "self_pairs": self.self_pairs, "cross_pairs": self.cross_pairs}


def mark_cross_attention(model) -> None:
    """Mark a model's ``attn2`` modules as cross-attention for modules without diffusers' flag."""
    for name, module in model.named_modules():
        if name.endswith("attn2"):
            module._workcount_cross = True

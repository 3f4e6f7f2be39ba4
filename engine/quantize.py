"""FP8 weights for the transformer (the `quantize` engine option, "fp8"): torchao's float8 dynamic quantisation.

`quantize_fp8(transformer)` applies torchao's `Float8DynamicActivationFloat8WeightConfig` (weights stored in
float8 e4m3 with a scale per output row; each activation quantised to float8 per row at run time; the matmul
is `torch._scaled_mm` on the GPU's FP8 tensor cores, its output in the model dtype) to the `nn.Linear` layers
of the repeated blocks: attention projections, cross-attention, feed-forward. What stays in `--dtype` (bf16),
and why:

- the patch, time, text (and image) embeddings: they run once per forward (nothing to gain) and the time
  embedding's modulation scales every block's activations (an error there is multiplied everywhere);
- the output projection `proj_out` (and Latte's `norm_out`/final layer): its output is the noise prediction
  itself, which the sampler integrates step after step;
- norms (LayerNorm, RMSNorm) and the modulation tables: not linear layers, and small;
- LoRA adapters are refused with fp8 at start (see `check_fp8`).

Everything here is refused at engine start (`check_fp8`, `ValueError` naming `quantize`), before a worker
loads anything: no CUDA device, one without FP8 (compute capability below 8.9: FP8 tensor cores came with
Ada and Hopper), torchao missing (an optional dependency: `pip install '.[gpu]'`), a dtype other than
bfloat16, or combinations that are not built.
"""

from __future__ import annotations

import importlib.util

import torch

#: (major, minor) CUDA compute capability with FP8 tensor cores (Ada Lovelace 8.9, Hopper 9.0, Blackwell)
FP8_CAPABILITY = (8, 9)
#: submodule names kept out of FP8 wherever they are (see the module docstring)
KEEP = ("patch_embedding", "pos_embed", "condition_embedder", "time_embedder", "time_proj", "text_embedder",
        "image_embedder", "adaln_single", "caption_projection", "proj_out", "norm_out", "norm")


def check_fp8(config, device: str) -> None:
    """Refuse `quantize="fp8"` where it cannot run (ValueError naming `quantize`); nothing when it can."""
    if config.quantize != "fp8":
        return
    why = None
    if device != "cuda" or not torch.cuda.is_available():
        why = (f"this engine runs on {device if device != 'cuda' else 'cuda, but no CUDA device is visible'}; "
               f"FP8 matmuls need an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper)")
    else:
        low = [i for i in range(torch.cuda.device_count()) if torch.cuda.get_device_capability(i) < FP8_CAPABILITY]
        if low:
            cap = torch.cuda.get_device_capability(low[0])
            why = (f"GPU {low[0]} ({torch.cuda.get_device_name(low[0])}) has compute capability {cap[0]}.{cap[1]}; "
                   f"FP8 matmuls need >= 8.9 (Ada, Hopper)")
        elif importlib.util.find_spec("torchao") is None:
            why = "torchao is not installed (pip install '.[gpu]', or pip install torchao)"
    if why is None and config.dtype not in ("bfloat16", "bf16"):
        why = (f"dtype is {config.dtype}; FP8 weights run with bfloat16 activations (the layers kept out of FP8 "
               f"and the matmuls' outputs), so give --dtype bfloat16")
    if why is None and config.loras:
        why = "LoRA adapters are applied per row on the base layers' outputs; with FP8 base layers that is not built"
    if why is None and config.offload == "expert":
        why = "expert offload keeps plain host copies of the experts' tensors; FP8 tensor subclasses are not built in"
    if why is None and config.parallel == "megatron-sp":
        why = "megatron-sp slices the weights of the linear layers by hand, which FP8 weights do not allow"
    if why is not None:
        raise ValueError(f"quantize='fp8' is not available: {why}")


def fp8_filter(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's `filter_fn`: the linear layers inside the repeated blocks, none of the kept-out modules, and only
    those whose sizes `torch._scaled_mm` takes (multiples of 16: every published model's; tiny-wan's 36 are not)."""
    if not isinstance(module, torch.nn.Linear) or module.in_features % 16 or module.out_features % 16:
        return False
    parts = fqn.split(".")
    if parts[0] not in ("blocks", "transformer_blocks", "temporal_transformer_blocks"):
        return False
    return not any(p in KEEP or p.startswith("norm") for p in parts)


def quantize_fp8(transformer: torch.nn.Module) -> int:
    """The transformer's block linears in FP8, in place (torchao imported here: an optional dependency).
    Returns how many layers were quantised."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    chosen = [name for name, m in transformer.named_modules() if fp8_filter(m, name)]
    if not chosen:
        raise ValueError(f"quantize='fp8': no linear layer of {type(transformer).__name__}'s blocks can be FP8 (none "
                         f"has sizes that are multiples of 16)")
    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=fp8_filter)
    return len(chosen)

"""Build the tiny, randomly initialised LoRA adapters shipped for tiny-wan: one in each of the two formats
people publish Wan LoRAs in, so that both go through diffusers' loaders in the tests.

Usage::

    python -m tools.weights.build_tiny_lora                        # (re)writes both shipped adapters
    python -m tools.weights.build_tiny_lora --kind musubi --out F  # writes the file F instead

* ``tiny-wan-lora`` (``weights/tiny-wan-lora/pytorch_lora_weights.safetensors``): **diffusers format**, written
  by diffusers' own ``WanPipeline.save_lora_weights`` (keys ``transformer.blocks.0.attn1.to_q.lora_A.weight``,
  the adapter's rank and alpha in the file's ``lora_adapter_metadata``). Rank 2, lora_alpha 4 (so the adapter's
  own scaling alpha / r is 2, not 1), on a few modules of every block (self-attention q and v, the
  cross-attention output, the FFN's second linear) and on ``proj_out``, the output projection, which the
  sequence-parallel plan gathers: an adapter there must be added before that gather.
* ``tiny-wan-lora-musubi`` (``weights/tiny-wan-lora-musubi/tiny_wan_lora_musubi.safetensors``): **kohya / musubi
  tuner format** (keys ``lora_unet_blocks_0_self_attn_q.lora_down.weight``, ``.lora_up.weight`` and a scalar
  ``.alpha`` per module), which diffusers converts on load (``_convert_musubi_wan_lora_to_diffusers``). That
  converter wants every module musubi trains in every block: self- and cross-attention q, k, v, o and the FFN's
  two linears. Rank 4, alpha 2 (scaling 0.5).

Both fit tiny-wan's transformer (3 heads x 12 = 36 wide, FFN 64, 2 blocks) and, since they touch neither the
patch embedding nor the image branch, also each expert of ``tiny-wan22-i2v-a14b`` (the same blocks, 20 input
channels) and tiny-wan-i2v (diffusers adds zero adapters for the image keys of a text-to-video LoRA).

The weights are drawn from a generator seeded per adapter, down (A) N(0, 1/in) and up (B) N(0, 1/r) x 0.5, so an
adapter at scale 1 moves every layer's output by a fraction of its own size: visible in the frames, and no
layer is left at diffusers' zero initialisation of B. Same library versions, same bytes. The weights are
meaningless.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from longserve.weights.registry import TINY_LORAS

SEED = 0
BLOCKS, INNER, FFN = 2, 36, 64          # tiny-wan's transformer (weights/build_tiny_wan.py)
KINDS = ("diffusers", "musubi")
DEFAULT_OUT = {"diffusers": TINY_LORAS["tiny-wan-lora"].parent, "musubi": TINY_LORAS["tiny-wan-lora-musubi"]}

# diffusers format: the modules of every block (name, in, out), and proj_out (36 -> 8 channels x 2 x 2 patch)
DIFFUSERS_BLOCK_MODULES = (("attn1.to_q", INNER, INNER), ("attn1.to_v", INNER, INNER),
                           ("attn2.to_out.0", INNER, INNER), ("ffn.net.2", FFN, INNER))
DIFFUSERS_RANK, DIFFUSERS_ALPHA = 2, 4
# musubi format: every module musubi trains in a Wan block (the converter requires all of them)
MUSUBI_BLOCK_MODULES = tuple((f"{kind}_attn_{o}", INNER, INNER) for kind in ("self", "cross") for o in "qkvo") + (
    ("ffn_0", INNER, FFN), ("ffn_2", FFN, INNER))
MUSUBI_RANK, MUSUBI_ALPHA = 4, 2.0


def _pair(gen: torch.Generator, rank: int, fan_in: int, fan_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    down = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5        # A: (r, in)
    up = torch.randn(fan_out, rank, generator=gen) * rank ** -0.5 * 0.5     # B: (out, r)
    return down.contiguous(), up.contiguous()


def diffusers_state_dict(seed: int = SEED) -> dict[str, torch.Tensor]:
    """The diffusers-format adapter's tensors, without the ``transformer.`` prefix (what save_lora_weights takes)."""
    gen = torch.Generator().manual_seed(seed)
    modules = [(f"blocks.{i}.{name}", fan_in, fan_out) for i in range(BLOCKS)
               for name, fan_in, fan_out in DIFFUSERS_BLOCK_MODULES] + [("proj_out", INNER, 8 * 2 * 2)]
    state = {}
    for name, fan_in, fan_out in modules:
        state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"] = _pair(gen, DIFFUSERS_RANK, fan_in, fan_out)
    return state


def musubi_state_dict(seed: int = SEED + 1) -> dict[str, torch.Tensor]:
    """The musubi-format adapter's tensors (``lora_unet_`` keys, kohya's down / up / alpha)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(BLOCKS):
        for name, fan_in, fan_out in MUSUBI_BLOCK_MODULES:
            key = f"lora_unet_blocks_{i}_{name}"
            state[f"{key}.lora_down.weight"], state[f"{key}.lora_up.weight"] = _pair(gen, MUSUBI_RANK, fan_in,
                                                                                     fan_out)
            state[f"{key}.alpha"] = torch.tensor(MUSUBI_ALPHA)
    return state


def build(kind: str, out: str | Path | None = None) -> Path:
    """Write the adapter `kind` to `out` (a directory for "diffusers", a file for "musubi"); return its path."""
    from safetensors.torch import save_file

    out = Path(out or DEFAULT_OUT[kind])
    if kind == "diffusers":
        from diffusers import WanPipeline

        state = diffusers_state_dict()
        targets = sorted({k.rsplit(".lora_", 1)[0] for k in state})
        WanPipeline.save_lora_weights(
            str(out), transformer_lora_layers=state, safe_serialization=True,
            transformer_lora_adapter_metadata={"r": DIFFUSERS_RANK, "lora_alpha": DIFFUSERS_ALPHA,
                                               "target_modules": targets})
        canonical_header(out / "pytorch_lora_weights.safetensors")
        (out / "pytorch_lora_weights.safetensors").chmod(0o644)
        return out
    if kind == "musubi":
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(musubi_state_dict(), str(out), metadata={"format": "pt"})
        out.chmod(0o644)
        return out
    raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")


def canonical_header(path: Path) -> None:
    """Rewrite a safetensors file's header with its metadata keys in sorted order (tensors and bytes unchanged).

    safetensors keeps the metadata in a Rust HashMap, so a file with more than one metadata key (diffusers writes
    "format" and "lora_adapter_metadata") comes out with the two in either order from run to run."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                 # the header is padded to 8 bytes, as safetensors writes it
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_lora", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=KINDS, default=None, help="which adapter (default: both)")
    ap.add_argument("--out", default=None, help="where to write it (default: the shipped path)")
    args = ap.parse_args(argv)
    if args.out is not None and args.kind is None:
        ap.error("--out needs --kind")
    for kind in (args.kind,) if args.kind else KINDS:
        path = build(kind, args.out)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        print(json.dumps({"kind": kind, "out": str(path), "bytes": sum(p.stat().st_size for p in files)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

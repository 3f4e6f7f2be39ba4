"""Write a causal Wan checkpoint directory (weights/causal_wan.py describes the layout) around a transformer.

    python -m tools.weights.build_causal --out DIR --components-from WAN_DIR [--layers N] [--dtype bfloat16]  # random

The transformer's weights are written in the released generators' layout (`model.` + the
original Wan names), as a training checkpoint `{"generator": sd, "generator_ema": sd}` when the
file name ends in `.pt` (how Self-Forcing ships `self_forcing_dmd.pt`) or flat safetensors
otherwise; the text encoder, tokenizer, VAE and scheduler are copied from a diffusers Wan
directory (`components_from`). Used by the tests (tiny random causal models), `bench live` and
`bench gpu` (a LongLive-1.3B-shaped model with random weights); `weights/tiny-live` is trained
(weights/train_tiny_live.py) and written in the same layout.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from longserve.weights.causal_wan import CAUSAL_CONFIG_FILE, to_upstream
from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS

#: LongLive-1.3B's loop as its configs set it (NVlabs/LongLive configs/longlive_inference.yaml, read for the
#: values: 3-frame blocks, 4 warped steps, shift 5, a local window of 12 latent frames with 3 sink frames)
LONGLIVE_CAUSAL = {"num_frame_per_block": 3, "denoising_step_list": [1000, 750, 500, 250],
                   "warp_denoising_step": True, "timestep_shift": 5.0, "local_attn_size": 12, "sink_size": 3,
                   "context_noise": 0, "fps": 16}

COMPONENTS = ("text_encoder", "tokenizer", "vae", "scheduler")


def build_causal_checkpoint(out: str | Path, transformer_config: dict, causal: dict, *, state_dict=None,
                            components_from: str | Path = TINY_MODELS["tiny-wan"], seed: int = 0,
                            weights_name: str = "model.safetensors", defaults: dict | None = None,
                            dtype=None) -> Path:
    """Write the directory; the transformer's weights are `state_dict` (diffusers names) or seeded random ones."""
    import torch
    from diffusers import WanTransformer3DModel

    from tools.weights.seeded import reinit_

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(components_from)
    for name in COMPONENTS:
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(src / name, out / name)
    index = json.loads((src / "model_index.json").read_text())
    index = {k: v for k, v in index.items() if k in ("_class_name", "_diffusers_version", *COMPONENTS)}
    index["_class_name"] = "WanPipeline"
    index["transformer"] = [None, None]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "transformer").mkdir(exist_ok=True)
    config = {k: v for k, v in transformer_config.items() if not k.startswith("_")}
    if state_dict is None:
        with torch.no_grad():
            model = reinit_(WanTransformer3DModel(**config), seed)
        state_dict = model.to(dtype).state_dict() if dtype is not None else model.state_dict()
    (out / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "WanTransformer3DModel", **config}, indent=2, sort_keys=True) + "\n")
    upstream = {k: v.contiguous() for k, v in to_upstream(state_dict).items()}
    if weights_name.endswith(".pt"):
        torch.save({"generator": upstream, "generator_ema": upstream}, out / weights_name)
        key = "generator_ema"
    else:
        from safetensors.torch import save_file

        save_file(upstream, str(out / weights_name))
        key = None
    (out / CAUSAL_CONFIG_FILE).write_text(json.dumps(
        {"weights": weights_name, "state_dict_key": key, "key_prefix": "model.", **causal}, indent=2) + "\n")
    if defaults is not None:
        (out / GENERATION_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")
    return out


def main(argv=None) -> None:
    from tools.weights.wan import WAN_2_1_T2V_1_3B_TRANSFORMER

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (default: the shape's)")
    ap.add_argument("--components-from", required=True,
                    help="a diffusers Wan directory whose text encoder, tokenizer, VAE and scheduler are copied")
    ap.add_argument("--transformer-config", default=None, metavar="JSON",
                    help="a WanTransformer3DModel config.json to use instead of Wan 2.1 1.3B's shape")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the weights' dtype on disk (default float32; bfloat16 halves the file)")
    args = ap.parse_args(argv)
    config = dict(WAN_2_1_T2V_1_3B_TRANSFORMER)
    if args.transformer_config:
        config = json.loads(Path(args.transformer_config).read_text())
    if args.layers:
        config["num_layers"] = args.layers
    import torch

    dtype = getattr(torch, args.dtype) if args.dtype else None
    print(build_causal_checkpoint(args.out, config, LONGLIVE_CAUSAL, components_from=args.components_from,
                                  dtype=dtype))


if __name__ == "__main__":
    main()

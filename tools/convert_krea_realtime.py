"""Turn Krea Realtime 14B as published into a causal checkpoint directory longserve serves live (the causal-wan
family; weights/causal_wan.py describes the directory).

    python -m tools.convert_krea_realtime SRC OUT --components-from WAN_DIFFUSERS_DIR [--copy]
    python -m tools.convert_krea_realtime --synthetic SRC [--layers 2] [--small]     # random, for tests and benches
    python -m tools.convert_krea_realtime --synthetic-components DIR [--small]      # a tiny Wan base to go with it

The published layout (krea/krea-realtime-video on the Hub, loaded by krea-ai/realtime-video's `release_server.py`,
`load_transformer`): one flat safetensors file, `krea-realtime-video-14b.safetensors`, holding the Self-Forcing
generator's state dict under the training wrapper's `model.` prefix and the *original* Wan 2.1 names
(`model.blocks.0.self_attn.q.weight`, ...); the upstream loader tells 14B from 1.3B by the width of
`model.blocks.0.self_attn.k.weight` (5120 against 1536). Its loop (configs/self_forcing_server_14b.yaml): blocks of
3 latent frames, denoising steps [1000, 750, 500, 250] warped through the shift-5 flow schedule, a context of 3
latent frames (`kv_cache_num_frames`, no sink frame). The text encoder (UMT5-XXL) and the VAE are Wan 2.1's,
which Krea's README takes from Wan-AI's folders: `--components-from` names a diffusers Wan 2.1 directory.

Nothing is fetched: SRC is a local directory. The weights file is linked into OUT untouched (`--copy` copies it);
the family maps its names onto diffusers' `WanTransformer3DModel` at load (weights/causal_wan.py, diffusers' own
converter) and `to_published` writes the family's weights back in the published layout. The transformer's config is
read off the file's tensor shapes (the header alone: no weights are loaded), so a file with a few of the 40 layers
(`--synthetic --layers 2`, what `longserve bench live` runs on a CPU) converts to a model of those layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

from longserve.weights.causal_wan import CAUSAL_CONFIG_FILE, to_upstream
from tools.weights.wan import WAN_2_1_T2V_14B_TRANSFORMER, WAN_2_1_VAE

PUBLISHED_WEIGHTS = "krea-realtime-video-14b.safetensors"
PREFIX = "model."
HEAD_DIM = 128                     # every published Wan 2.1 width: 1.3B 12 x 128, 14B 40 x 128
#: the loop of configs/self_forcing_server_14b.yaml, in causal_config.json's words
KREA_CAUSAL = {"num_frame_per_block": 3, "denoising_step_list": [1000, 750, 500, 250], "warp_denoising_step": True,
               "timestep_shift": 5.0, "local_attn_size": 6, "sink_size": 0, "context_noise": 0, "fps": 16}
COMPONENTS = ("text_encoder", "tokenizer", "vae")
#: `--small`: the published names at a toy width (2 heads of 128), for a conversion test in seconds
SMALL = {"num_attention_heads": 2, "ffn_dim": 512, "text_dim": 32, "num_layers": 2}


def find_weights(src: Path) -> Path:
    """The published file in SRC (by its name, else the one safetensors file there)."""
    if (src / PUBLISHED_WEIGHTS).is_file():
        return src / PUBLISHED_WEIGHTS
    found = sorted(src.glob("*.safetensors"))
    if len(found) != 1:
        raise ValueError(f"{src}: expected {PUBLISHED_WEIGHTS} (or one .safetensors file); found "
                         f"{[p.name for p in found] or 'none'}")
    return found[0]


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the safetensors header (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def transformer_config(shapes: dict[str, tuple[int, ...]]) -> dict:
    """The diffusers `WanTransformer3DModel` config of a published-layout state dict, from its shapes."""
    def shape(name: str) -> tuple[int, ...]:
        if PREFIX + name not in shapes:
            raise ValueError(f"not a Wan generator in the published layout: no {PREFIX + name!r} (names look like "
                             f"{sorted(shapes)[:3]})")
        return shapes[PREFIX + name]

    dim, in_channels, *patch = shape("patch_embedding.weight")
    layers = 1 + max(int(m.group(1)) for k in shapes if (m := re.match(rf"{re.escape(PREFIX)}blocks\.(\d+)\.", k)))
    if dim % HEAD_DIM:
        raise ValueError(f"width {dim} is not a whole number of {HEAD_DIM}-wide heads (Wan 2.1's head size)")
    return {**WAN_2_1_T2V_14B_TRANSFORMER, "num_attention_heads": dim // HEAD_DIM, "attention_head_dim": HEAD_DIM,
            "num_layers": layers, "ffn_dim": shape("blocks.0.ffn.0.weight")[0], "in_channels": in_channels,
            "out_channels": shape("head.head.weight")[0] // (patch[0] * patch[1] * patch[2]),
            "text_dim": shape("text_embedding.0.weight")[1], "freq_dim": shape("time_embedding.0.weight")[1],
            "patch_size": list(patch), "cross_attn_norm": PREFIX + "blocks.0.norm3.weight" in shapes}


def convert(src: str | Path, out: str | Path, components_from: str | Path, copy: bool = False) -> Path:
    """Write OUT: causal_config.json, transformer/config.json, the weights (linked or copied), the Wan 2.1 text
    encoder, tokenizer and VAE (copied from `components_from`), a flow scheduler at Krea's shift, model_index.json."""
    src, out, base = Path(src), Path(out), Path(components_from)
    weights = find_weights(src)
    config = transformer_config(read_shapes(weights))
    text = json.loads((base / "text_encoder" / "config.json").read_text())
    vae = json.loads((base / "vae" / "config.json").read_text())
    if text["d_model"] != config["text_dim"] or vae["z_dim"] != config["in_channels"]:
        raise ValueError(f"--components-from {base}: its text encoder is {text['d_model']} wide and its VAE has "
                         f"{vae['z_dim']} latent channels; the transformer takes {config['text_dim']} and "
                         f"{config['in_channels']} (Wan 2.1's are 4096 and 16)")
    out.mkdir(parents=True, exist_ok=True)
    for name in COMPONENTS:
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(base / name, out / name)
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
         "shift": KREA_CAUSAL["timestep_shift"]}, indent=2) + "\n")
    (out / "transformer").mkdir(exist_ok=True)
    (out / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "WanTransformer3DModel", **config}, indent=2, sort_keys=True) + "\n")
    index = {"_class_name": "WanPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
             "transformer": [None, None], "vae": ["diffusers", "AutoencoderKLWan"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    target = out / weights.name
    if target.exists() or target.is_symlink():
        target.unlink()
    if copy:
        shutil.copyfile(weights, target)
    else:
        os.symlink(weights.resolve(), target)
    (out / CAUSAL_CONFIG_FILE).write_text(json.dumps(
        {"weights": weights.name, "state_dict_key": None, "key_prefix": PREFIX, **KREA_CAUSAL}, indent=2) + "\n")
    return out


def to_published(model_dir: str | Path, dest: str | Path) -> Path:
    """The family's transformer (as it loads `model_dir`) written back in the published layout: the inverse."""
    from safetensors.torch import save_file

    from longserve.weights.causal_wan import load_causal_transformer

    model = load_causal_transformer(model_dir)
    save_file({k: v.contiguous() for k, v in to_upstream(model.state_dict(), PREFIX).items()}, str(dest))
    return Path(dest)


def write_synthetic(src: str | Path, layers: int = 2, small: bool = False, seed: int = 0, dtype: str = "bfloat16"):
    """A random generator in the published layout at Wan 2.1 14B's widths (`small`: a toy width), `layers` blocks:
    src/krea-realtime-video-14b.safetensors. Drawn tensor by tensor (N(0, 0.02), norms 1), so a 14B-wide file needs
    about its own size in memory."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    config = {**WAN_2_1_T2V_14B_TRANSFORMER, **(SMALL if small else {}), "num_layers": layers}
    config["attention_head_dim"] = HEAD_DIM
    with init_empty_weights():
        shapes = {k: v.shape for k, v in WanTransformer3DModel(**config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        t = torch.randn(shapes[name], generator=gen) * 0.02
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm2.weight")):
            t = t + 1.0                                               # the norms' gains about 1
        tensors[name] = t.to(getattr(torch, dtype))
    src = Path(src)
    src.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in to_upstream(tensors, PREFIX).items()}, str(src / PUBLISHED_WEIGHTS))
    return src / PUBLISHED_WEIGHTS


def write_synthetic_components(out: str | Path, small: bool = False) -> Path:
    """A Wan base for a synthetic generator: tiny-wan's tokenizer, a tiny UMT5 as wide as the generator's text input
    (4096; `small`: 32) and a tiny Wan VAE with its 16 latent channels (random weights)."""
    from longserve.weights.registry import TINY_MODELS
    from tools.weights.build_tiny_wan import build_text_encoder, build_vae

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "tokenizer").exists():
        shutil.rmtree(out / "tokenizer")
    shutil.copytree(TINY_MODELS["tiny-wan"] / "tokenizer", out / "tokenizer")
    d_model = SMALL["text_dim"] if small else WAN_2_1_T2V_14B_TRANSFORMER["text_dim"]
    build_text_encoder(d_model=d_model).save_pretrained(str(out / "text_encoder"))
    z = WAN_2_1_VAE["z_dim"]
    build_vae(z_dim=z, latents_mean=WAN_2_1_VAE["latents_mean"], latents_std=WAN_2_1_VAE["latents_std"]
              ).save_pretrained(str(out / "vae"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.convert_krea_realtime", description=__doc__.split("\n")[0])
    ap.add_argument("src", nargs="?", help="a local directory in the published layout")
    ap.add_argument("out", nargs="?", help="the causal checkpoint directory to write")
    ap.add_argument("--components-from", help="a diffusers Wan 2.1 directory (text encoder, tokenizer, VAE)")
    ap.add_argument("--copy", action="store_true", help="copy the weights file instead of linking it")
    ap.add_argument("--synthetic", metavar="SRC", help="write a random generator in the published layout to SRC")
    ap.add_argument("--synthetic-components", metavar="DIR", help="write a tiny random Wan base to DIR")
    ap.add_argument("--layers", type=int, default=2, help="--synthetic: blocks (the published model has 40)")
    ap.add_argument("--small", action="store_true", help="--synthetic*: a toy width instead of the published one")
    args = ap.parse_args(argv)
    if args.synthetic:
        print(write_synthetic(args.synthetic, args.layers, args.small))
    if args.synthetic_components:
        print(write_synthetic_components(args.synthetic_components, args.small))
    if args.src or args.out:
        if not (args.src and args.out and args.components_from):
            ap.error("converting needs SRC, OUT and --components-from")
        print(convert(args.src, args.out, args.components_from, args.copy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

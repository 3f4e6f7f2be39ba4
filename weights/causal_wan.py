"""Causal few-step Wan checkpoints (Self-Forcing, LongLive, CausVid kind) as longserve loads them.

The released checkpoints ship the generator's weights in the *original* Wan code's layout
(`wan/modules/model.py`, the `WanModel` those repos subclass as `CausalWanModel`), wrapped
by their training code:

    self_forcing_dmd.pt   (gdhe17/Self-Forcing, checkpoints/)   {"generator": sd, "generator_ema": sd, ...}
    longlive_base.pt      (Efficient-Large-Model/LongLive-1.3B, models/)  {"generator": sd, ...}
    causvid ... model.pt  (tianweiy/CausVid, autoregressive_checkpoint/) {"generator": sd}

where each `sd` maps `model.<original Wan name>` (the wrapper's `self.model`) to a tensor,
e.g. `model.blocks.0.self_attn.q.weight`. longserve keeps those files as they are and maps
the names onto diffusers' `WanTransformer3DModel` at load time, with diffusers' own
converter for original Wan checkpoints (`convert_wan_transformer_to_diffusers`), after
stripping the wrapper's prefix. `to_upstream` is the inverse, used to write the tiny
checkpoints in the released layout.

A causal checkpoint directory::

    causal_config.json          longserve's description of the causal model (below)
    <weights>                   the released generator file (.pt or .safetensors), untouched
    transformer/config.json     the diffusers WanTransformer3DModel config of that generator
    model_index.json            a diffusers WanPipeline index whose "transformer" entry is [null, null]
    text_encoder/ tokenizer/ vae/ scheduler/   the base model's (for the released ones: symlinks to the
                                folders of Wan-AI/Wan2.1-T2V-1.3B-Diffusers, which their inference scripts load)

causal_config.json::

    {"weights": "self_forcing_dmd.pt",        the generator file, relative to the directory
     "state_dict_key": "generator_ema",       the entry of a training checkpoint holding the weights (null: top level)
     "key_prefix": "model.",                  stripped from every name before the Wan -> diffusers mapping
     "num_frame_per_block": 3,                latent frames per chunk
     "denoising_step_list": [1000, 750, 500, 250],
     "warp_denoising_step": true,             map the list through the shifted flow schedule (as upstream)
     "timestep_shift": 5.0,
     "local_attn_size": 12,                   latent frames a chunk attends to, itself included
     "sink_size": 3,                          the first frames, never evicted
     "context_noise": 0,                      the timestep of the pass that writes a finished chunk's K/V
     "fps": 16}

Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CAUSAL_CONFIG_FILE = "causal_config.json"

#: diffusers name fragment -> original Wan name fragment, applied in order (the inverse of diffusers'
#: `convert_wan_transformer_to_diffusers` for text-to-video checkpoints). norm2/norm3 swap places: the
#: original's norm3 (before cross-attention) is diffusers' norm2 and the original's norm2 (before the
#: FFN) diffusers' norm3; neither is a parameter unless cross_attn_norm (norm3 then has weight and bias).
_TO_UPSTREAM = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".norm2.", ".norm__swap."),
    (".norm3.", ".norm2."),
    (".norm__swap.", ".norm3."),
)


def to_upstream(state_dict: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """A diffusers `WanTransformer3DModel` state dict -> the released generators' names (`model.blocks.0...`)."""
    out = {}
    for name, tensor in state_dict.items():
        new = name
        if name == "scale_shift_table":
            new = "head.modulation"
        elif name.startswith("proj_out."):
            new = "head.head." + name[len("proj_out."):]
        elif name.endswith(".scale_shift_table"):
            new = name[:-len("scale_shift_table")] + "modulation"
        for a, b in _TO_UPSTREAM:
            new = new.replace(a, b)
        out[prefix + new] = tensor
    return out


def from_upstream(state_dict: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """The released generators' names -> diffusers' (diffusers' own converter, after stripping `prefix`)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    stripped = {}
    for name, tensor in state_dict.items():
        if prefix and not name.startswith(prefix):
            raise ValueError(f"parameter {name!r} does not start with key_prefix {prefix!r}")
        stripped[name[len(prefix):]] = tensor
    return convert_wan_transformer_to_diffusers(stripped)


def read_causal_config(model_dir: str | Path) -> dict:
    with open(Path(model_dir) / CAUSAL_CONFIG_FILE, encoding="utf-8") as f:
        return json.load(f)


def is_causal_checkpoint(model_dir: str | Path) -> bool:
    return (Path(model_dir) / CAUSAL_CONFIG_FILE).is_file()


def read_generator(path: str | Path, state_dict_key: str | None) -> dict:
    """The generator's tensors from a released file: a .safetensors, or a torch training checkpoint
    (loaded with weights_only: tensors and plain containers only, no code)."""
    import torch

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if state_dict_key:
        if state_dict_key not in sd:
            raise ValueError(f"{path}: no entry {state_dict_key!r} (state_dict_key in {CAUSAL_CONFIG_FILE}); "
                             f"it has {sorted(sd)[:8]}")
        sd = sd[state_dict_key]
    return sd


def load_causal_transformer(model_dir: str | Path, dtype=None):
    """diffusers' `WanTransformer3DModel` with the released generator's weights (strict: no missing or
    unexpected parameters)."""
    from diffusers import WanTransformer3DModel

    model_dir = Path(model_dir)
    cfg = read_causal_config(model_dir)
    from accelerate import init_empty_weights

    with init_empty_weights():              # parameters on "meta" (the file fills them); rope buffers built
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(model_dir / "transformer"))
    sd = from_upstream(read_generator(model_dir / cfg["weights"], cfg.get("state_dict_key")),
                       cfg.get("key_prefix", "model."))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"{model_dir / cfg['weights']}: does not fit the transformer config: missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(sd, assign=True, strict=True)
    model.eval()
    if dtype is not None:
        # what diffusers' from_pretrained(dtype=...) does: the modules it lists stay in float32 (and a file saved in
        # bfloat16, as released generators often are, runs in the engine's dtype, float32 included)
        keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, p in model.named_parameters():
            p.data = p.data.float() if keep & set(name.split(".")) else p.data.to(dtype)
    return model

"""What a worker imports, imported once in the pool's fork server so that every CPU worker starts forked from it.

A spawned worker imports torch, diffusers, transformers and the pipeline classes anew;
forked from a server that imported them once, it starts at once, and so does a pool
restart after a crash (the figures are in docs/design.md, "Worker pool"). Only imports
happen here: no tensor work, no threads, no CUDA (CUDA pools spawn, see
`engine.startup.start_method`). Anything missing is skipped: a worker imports what it needs.
"""

from __future__ import annotations

import gc
import importlib
import sys

MODULES = tuple(f"longserve.engine.{m}" for m in (
    "worker", "lss", "families.latte", "families.wan", "families.wan_i2v", "families.wan_ti2v", "families.skyreels_df",
    "offload", "models.latte", "models.wan", "causal_vae"))
#: (module, attribute): diffusers and transformers import their classes lazily, on attribute access
CLASSES = (("diffusers", "LattePipeline"), ("diffusers", "WanPipeline"), ("diffusers", "WanImageToVideoPipeline"),
           ("diffusers", "SkyReelsV2Pipeline"), ("diffusers", "SkyReelsV2DiffusionForcingPipeline"),
           ("diffusers", "AutoencoderKLWan"),
           ("transformers", "AutoModelForCausalLM"), ("transformers", "AutoTokenizer"),
           ("transformers", "T5EncoderModel"), ("transformers", "UMT5EncoderModel"),
           ("transformers", "CLIPVisionModel"), ("transformers", "CLIPImageProcessor"))


def preload() -> None:
    from longserve.engine.families import pil_image_processors

    pil_image_processors()        # before CLASSES: transformers' torchvision warning, engine/families/__init__.py
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing optional piece is the worker's problem, not the server's
            pass
    for module, attr in CLASSES:
        try:
            getattr(importlib.import_module(module), attr)
        except Exception:  # noqa: BLE001
            pass
    # before the forks (the gc module's own advice): a worker's collections never scan, nor write to, the imported
    # objects' pages, which stay shared with the fork server instead of being copied into every worker. Imported by
    # engine/zygote.py in the caller's process, the caller's heap is left alone: the zygote's copy freezes its own.
    zygote = sys.modules.get("longserve.engine.zygote")
    if not getattr(zygote, "IMPORTING", False):
        gc.freeze()


preload()

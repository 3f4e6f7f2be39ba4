"""`profile`: one switch for the speed levers that win on the engine's device ("fast"), or none of them ("exact", the
default: every output is the reference pipeline's).

"fast" turns on, for every lever option left unset (None; an option given is kept, "none" or its off value included,
so each lever stays its own switch under the profile), what was measured to win where it runs:

    lever                 where                         why (docs/benchmarks.md, docs/gpu.md)
    regional compile      CUDA, families that compile   1.42x on the Wan 1.3B transformer (H200); 0.99x on 2 CPU
                                                        cores (dispatch-bound), so not on CPU
    attention backend     CUDA, bf16/fp16, diffusers'   the first of `ATTENTION_CANDIDATES` installed and allowed
                          dispatcher, Ulysses/1 worker  by the plan (each worker probes it on its GPU at start)
    bf16 VAE              CUDA, Wan family              the Wan VAE's decode in bfloat16, as a bf16 Wan pipeline
    VAE rows split        several workers, untiled      engine/vae_split.py: the decode on N workers, exact
    step caching          families with `cache`         FirstBlockCache at `FAST_CACHE`'s threshold, calibrated on
                                                        the trained tiny-latte (bench speed: no prompt lost)
    CFG truncation        families with cfg_trunc_ratio the unconditional branch skipped on the last steps
                                                        (`FAST_CFG_TRUNC`), measured the same way

Left off: FP8 (`quantize`): torchao's dynamic float8 alone ran at 0.69x (slower) on the H200 and FP8 with compile
was never measured to finish (docs/gpu.md); the profile turns on only what was measured to win.
"""

from __future__ import annotations

import json

PROFILES = ("exact", "fast")

#: FirstBlockCache's threshold under the fast profile, calibrated on the trained tiny-latte over a 12-prompt grid
#: (`bench speed --prompts 12 --spread`, docs/benchmarks.md): 0.2 / 0.3 / 0.4 skip to 1.93x / 2.39x / 2.82x fewer
#: blocks at 29.6 / 28.4 / 25.9 dB against exact, every prompt recognised at each
FAST_CACHE = {"kind": "first_block", "threshold": 0.3}
#: CFG truncation under the fast profile, calibrated the same way: 0.7 / 0.6 / 0.5 / 0.3 run 1.19x / 1.25x / 1.35x /
#: 1.56x fewer blocks at 31.0 / 29.0 / 26.7 / 24.0 dB, every prompt recognised at each: the second half of the steps
#: (the low-noise ones, where the prediction's conditional part already dominates) without the unconditional branch
FAST_CFG_TRUNC = 0.5
#: attention backends tried in order on CUDA (the first installed one that the family and plan take)
ATTENTION_CANDIDATES = ("_flash_3", "flash", "sage")


#: the lever options, and what each is when the profile leaves it off
OFF = {"compile": "none", "attention_backend": None, "vae_dtype": None, "vae_split": "items", "cache": None,
       "cfg_trunc_ratio": None}


def fast_levers(config, family, desc, plan, device: str) -> dict:
    """The lever fields the fast profile turns on for this engine: {field: value}, unset fields only."""
    untouched = {name for name in OFF if getattr(config, name) is None}
    levers = {}
    cuda = device.startswith("cuda")
    if cuda and "compile" in untouched and family.supports_compile and not config.loras:
        levers["compile"] = "blocks"
    if cuda and "attention_backend" in untouched and config.dtype in ("bfloat16", "float16") \
            and family.dispatcher_attention:
        backend = best_attention_backend(family, plan, config.workers)
        if backend is not None:
            levers["attention_backend"] = backend
    if cuda and "vae_dtype" in untouched:
        levers["vae_dtype"] = "bfloat16"
    if config.workers > 1 and "vae_split" in untouched and not config.vae_tiling:
        levers["vae_split"] = "rows"
    if "cache" in untouched and "cache" in desc.options:
        levers["cache"] = json.dumps(FAST_CACHE)
    if "cfg_trunc_ratio" in untouched and "cfg_trunc_ratio" in desc.options:
        levers["cfg_trunc_ratio"] = FAST_CFG_TRUNC
    return levers


def best_attention_backend(family, plan, workers: int) -> str | None:
    """The first of `ATTENTION_CANDIDATES` whose package is installed and which the family and plan take."""
    from longserve.engine.attention import check_installed, check_plan

    for name in ATTENTION_CANDIDATES:
        try:
            check_plan(name, family, plan, workers)
            check_installed(name)
        except ValueError:
            continue
        return name
    return None


def resolve_profile(config, family, desc):
    """The engine config with the profile's levers applied and every lever option resolved (the config itself under
    "exact", whose unset levers are already off)."""
    if config.profile == "exact":
        return config
    from longserve.engine.dist import default_device

    plan = family.resolve_plan(desc, config.parallel, config.workers, config.ulysses_degree, config.cfg_parallel)
    levers = fast_levers(config, family, desc, plan, config.device or default_device())
    for name, off in OFF.items():
        value = getattr(config, name)
        if name not in levers and (value is None or value == "none"):
            levers[name] = off                                 # unset, or given as "none": off
    return config.replace(**levers)

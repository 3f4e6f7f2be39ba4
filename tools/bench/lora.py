"""`longserve bench lora`: what a LoRA adapter per request costs a denoising step, side by side in one run.

    longserve bench lora [--config bench|tiny] [--rank 64] [--steps 7 --warmup 1] [--json out.json]

One step of a batch of two requests under classifier-free guidance is one transformer forward of 4 rows
([uncond; cond] each). The model is a `WanTransformer3DModel` with Wan 2.1 1.3B's width (12 heads x 128 = 1536,
FFN 8960, text dim 4096) but 2 blocks instead of 30, random weights (`tools.bench.models.random_wan_transformer`),
fp32, `torch.no_grad`, one process (the adapters' cost is the same on every worker: each holds all rows of its
shard of the sequence). Input: 2 latent frames of 16 x 16 (128 tokens per row), 512 text tokens.

The adapters are LightX2V-shaped: rank `--rank` on every linear of every block (self- and cross-attention q, k, v,
o and the FFN's two), random, written as diffusers-format files and loaded by `engine.lora.LoraSet` through
`WanPipeline.load_lora_weights`, exactly as a worker loads `--lora` files. Rows:

- `no adapter loaded`: the plain model (a second copy, never touched by peft): the baseline;
- `loaded, no row uses one`: the adapters loaded, a batch of requests without any (peft's wrappers and our
  hooks, which return at once);
- `one adapter, every row`: both requests name adapter a (the per-row path sees equal rows and computes peft's
  expression on the whole input);
- `peft set_adapters (one)`: the same through peft's own forward (`set_adapters("a")`), for reference;
- `two adapters, two rows each`: request 1 names a, request 2 names b (the rows of each gathered, computed,
  scaled per row and added back);
- `one adapter, half the rows`: request 1 names a, request 2 none.

Rounds are interleaved (round r times every row once), after `--warmup` discarded rounds; the median and the
fastest round are reported, each with its overhead over the first row's. Other processes on the machine only ever
add time, so on a shared machine the fastest round is the steadier figure; the load average is recorded.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import util as benchutil

CONFIGS = {
    "bench": dict(heads=12, head_dim=128, ffn=8960, text_dim=4096, layers=2, frames=2, latent=(16, 16),
                  text_len=512, rank=64),
    "tiny": dict(heads=3, head_dim=12, ffn=64, text_dim=32, layers=2, frames=2, latent=(8, 8), text_len=16,
                 rank=4),
}
#: every linear LightX2V's step-distillation LoRAs adapt in a Wan block (diffusers' names)
BLOCK_MODULES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                 "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
#: (row name, the four rows' adapters: per request, two rows each)
CASES = (("no adapter loaded", None), ("loaded, no row uses one", ([], [])),
         ("one adapter, every row", (["a"], ["a"])), ("peft set_adapters (one)", "peft"),
         ("two adapters, two rows each", (["a"], ["b"])), ("one adapter, half the rows", (["a"], [])))


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="bench", choices=list(CONFIGS))
    parser.add_argument("--rank", type=int, default=None, help="the adapters' rank (default: the config's)")
    parser.add_argument("--steps", type=int, default=7, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds first")
    parser.add_argument("--json", default=None, metavar="PATH")


def _write_adapter(model, rank: int, seed: int, path: Path) -> None:
    """A random diffusers-format adapter of `rank` on BLOCK_MODULES of every block of `model`."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, block in enumerate(model.blocks):
        for name in BLOCK_MODULES:
            linear = block.get_submodule(name)
            key = f"transformer.blocks.{i}.{name}"
            fan_in, fan_out = linear.in_features, linear.out_features
            state[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            state[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * rank ** -0.5 * 0.1
    save_file(state, str(path))


def run(args) -> int:
    import copy

    import torch
    from diffusers import WanPipeline

    from longserve.engine.lora import LoraSet, parse_adapters
    from tools.bench.models import random_wan_transformer

    cfg = dict(CONFIGS[args.config])
    rank = args.rank or cfg["rank"]
    plain = random_wan_transformer(heads=cfg["heads"], head_dim=cfg["head_dim"], layers=cfg["layers"],
                                   text_dim=cfg["text_dim"], in_channels=16, ffn_dim=cfg["ffn"])
    model = copy.deepcopy(plain)
    with tempfile.TemporaryDirectory(prefix="longserve-bench-lora-") as tmp:
        paths = {}
        for seed, name in enumerate("ab"):
            paths[name] = Path(tmp) / f"{name}.safetensors"
            _write_adapter(model, rank, seed, paths[name])
        shell = WanPipeline(tokenizer=None, text_encoder=None, transformer=model, vae=None, scheduler=None)
        lora = LoraSet(shell, parse_adapters({k: str(v) for k, v in paths.items()}))

    g = torch.Generator().manual_seed(0)
    h, w = cfg["latent"]
    x = torch.randn(4, 16, cfg["frames"], h, w, generator=g)                       # 2 requests x [uncond; cond]
    t = torch.full((4,), 500.0)
    text = torch.randn(4, cfg["text_len"], cfg["text_dim"], generator=g)

    def step(case) -> float:
        rows = case[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            if rows is None:
                plain(x, t, text, return_dict=False)
            elif rows == "peft":
                model.enable_lora()
                model.set_adapters("a", 1.0)
                try:
                    model(x, t, text, return_dict=False)
                finally:
                    model.disable_lora()
            else:
                per_request = [([{"name": n, "scale": 1.0} for n in r], 2) for r in rows]
                with lora.applied(per_request):
                    model(x, t, text, return_dict=False)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    load_before = benchutil.load_average()
    for r in range(args.warmup + args.steps):
        print(f"round {r + 1}/{args.warmup + args.steps}", file=sys.stderr)
        for case in CASES:
            elapsed = step(case)
            if r >= args.warmup:
                times[case[0]].append(elapsed)
    machine = benchutil.machine_info("cpu")
    base, base_min = statistics.median(times[CASES[0][0]]), min(times[CASES[0][0]])
    rows = []
    for name, _ in CASES:
        med, fastest = statistics.median(times[name]), min(times[name])
        rows.append(dict(case=name, rows=4, step_s=med, overhead_pct=100 * (med / base - 1), min_step_s=fastest,
                         min_overhead_pct=100 * (fastest / base_min - 1), rank=rank,
                         config=args.config, tokens_per_row=cfg["frames"] * (h // 2) * (w // 2),
                         threads=torch.get_num_threads(), loadavg_before=load_before,
                         loadavg_after=benchutil.load_average(), machine=machine))
    columns = [("case", "case"), ("median step s", "step_s", ".3f"), ("vs no adapter %", "overhead_pct", "+.1f"),
               ("fastest step s", "min_step_s", ".3f"), ("vs no adapter %", "min_overhead_pct", "+.1f")]
    print(benchutil.text_table(rows, columns))
    print()
    print(benchutil.markdown_table(rows, columns))
    if args.json:
        benchutil.write_json(rows, args.json)
    return 0

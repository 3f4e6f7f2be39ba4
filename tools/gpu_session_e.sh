#!/usr/bin/env bash
# The fifth GPU session recorded in docs/gpu.md (2026-11-26): live video at LongLive-1.3B's shape (832x480, §7), the
# whole Wan 1.3B video against diffusers with each stage timed and both VAE dtypes (§3), FP8 and regional compile on
# it, the SDPA backends of our Wan step on this card. Run from the repo root on the GPU machine (wheels in .whl/,
# results under $OUT); each step under its own limit, all inside DEADLINE_S, every step's output in $OUT/session.log.
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-480}))
W=${WORK:-/tmp/lsgpu}


nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, diffusers, transformers, torchao; print(torch.__version__, diffusers.__version__, \
transformers.__version__, torchao.__version__)" 2>&1 | tail -1 | tee -a "$LOG"
step build-wan 100 python3 -c "import argparse; from tools.bench.gpu_wan import checkpoint; \
from tools.bench.gpu import build_wan_dir; \
print(checkpoint(argparse.Namespace(work_dir='$W', smoke=False), 'wan2.1-1.3b', build_wan_dir))"
step build-longlive 80 python3 -m tools.weights.build_causal --out "$W/longlive" --components-from "$W/wan2.1-1.3b" \
  --dtype bfloat16
step live 110 python3 -m longserve.server.cli bench live --model "$W/longlive" --size 832x480 --device cuda \
  --dtype bfloat16 --seconds 12 --memory-chunks 10,60 --no-df --json "$OUT/live.json"
step wan-stages 120 python3 -m longserve.server.cli bench gpu --sections wan-stages --work-dir "$W" \
  --json "$OUT/gpu.jsonl"
step levers 150 python3 -m longserve.server.cli bench gpu --sections levers --work-dir "$W" --lever-steps 10 \
  --json "$OUT/gpu.jsonl"
step speed 80 python3 -m longserve.server.cli bench gpu --sections speed --models wan2.1-1.3b --repeats 3 \
  --json "$OUT/gpu.jsonl"
cp "$LOG" "$OUT/session.log" 2>/dev/null; true

#!/usr/bin/env bash
# The next GPU session, prepared (not run yet): what the 2026-11-26 lease (tools/gpu_session_e.sh) did not reach, in
# the brief's order. Live at LongLive-1.3B's shape with a chunk's time by stage, then with a bf16 VAE (§7); FP8 with
# compile on Wan 1.3B (§3); diffusers' dispatcher backends on our Wan step; the new families' shaped transformers.
# Run from the repo root on the GPU machine (wheels in .whl/, see docs/gpu.md); results under $OUT.
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-500}))
W=${WORK:-/tmp/lsgpu}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
step build-wan 100 python3 -c "import argparse; from tools.bench.gpu_wan import checkpoint; \
from tools.bench.gpu_models import build_wan_dir; \
print(checkpoint(argparse.Namespace(work_dir='$W', smoke=False), 'wan2.1-1.3b', build_wan_dir))"
step build-longlive 80 python3 -m tools.weights.build_causal --out "$W/longlive" --components-from "$W/wan2.1-1.3b" \
  --dtype bfloat16
step live 90 python3 -m longserve.server.cli bench live --model "$W/longlive" --size 832x480 --device cuda \
  --dtype bfloat16 --seconds 12 --memory-chunks 10,60 --no-df --json "$OUT/live.json"
step live-bf16-vae 70 python3 -m longserve.server.cli bench live --model "$W/longlive" --size 832x480 --device cuda \
  --dtype bfloat16 --vae-dtype bfloat16 --seconds 12 --memory-chunks 10 --no-df --json "$OUT/live_bf16_vae.json"
step fp8-compile 150 python3 -m longserve.server.cli bench gpu --sections levers --levers exact,fp8+compile \
  --work-dir "$W" --lever-steps 10 --json "$OUT/gpu.jsonl"
step backends 90 python3 -m longserve.server.cli bench gpu --sections backends --repeats 3 --json "$OUT/gpu.jsonl"
step ltx2-shaped 70 python3 -m longserve.server.cli bench transformer --model ltx2-shaped --device cuda \
  --dtype bfloat16 --workers 1 --strategies ulysses --layers 16 --steps 3 --warmup 1 --json "$OUT/ltx2.json"
step hunyuan15-shaped 70 python3 -m longserve.server.cli bench transformer --model hunyuan15-shaped --device cuda \
  --dtype bfloat16 --workers 1 --strategies ulysses --layers 8 --steps 3 --warmup 1 --json "$OUT/hy15.json"

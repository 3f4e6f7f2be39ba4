#!/usr/bin/env bash
# The fast profile on a GPU (issue 43), prepared, not run yet (no GPU was lent to the session that wrote it): in one
# command, a whole Wan 2.1 1.3B video under --profile fast lever by lever against exact and diffusers' WanPipeline;
# one denoising step at the Wan 2.1 I2V 14B 480p shape (2 of its 40 blocks, the figure scaled back to 40; LightX2V's
# one-H100 figure: 5.18 s) with compile + the best attention backend, and FP8 with compile; the attention backends on
# our Wan step; the Wan VAE's rows split on the GPUs there are. Run from the repo root on the GPU machine (wheels in
# .whl/, see docs/gpu.md); results under $OUT.  CPU check of the same sections at tiny shapes:
#   longserve bench gpu --smoke --device cpu --profile fast
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-540}))
W=${WORK:-/tmp/lsgpu}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
step build-wan 100 python3 -c "import argparse; from tools.bench.gpu_wan import checkpoint; \
from tools.bench.gpu_models import build_wan_dir; \
print(checkpoint(argparse.Namespace(work_dir='$W', smoke=False), 'wan2.1-1.3b', build_wan_dir))"
step step-14b 150 python3 -m longserve.server.cli bench gpu --sections step-14b --step-layers 2 --repeats 3 \
  --work-dir "$W" --json "$OUT/gpu_fast.jsonl"
step fast-video 200 python3 -m longserve.server.cli bench gpu --sections fast --lever-steps 20 --work-dir "$W" \
  --json "$OUT/gpu_fast.jsonl"
step backends 60 python3 -m longserve.server.cli bench gpu --sections backends --repeats 3 --json "$OUT/gpu_fast.jsonl"
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -ge 2 ]; then
  step vae-rows 60 python3 -m longserve.server.cli bench vae --model wan2.1 --workers 1,2 --frames 17 \
    --long-frames 0 --size 832x480 --tile off --split rows --no-memory --json "$OUT/vae_rows.json"
fi

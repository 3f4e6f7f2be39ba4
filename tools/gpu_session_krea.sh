#!/usr/bin/env bash
# Prepared, not run (issue 45: this task was lent no GPU): Krea Realtime 14B's shape live on one GPU, at full depth.
# A random generator in the published layout (40 blocks at Wan 2.1 14B's widths, bfloat16: about 28 GB on disk and on
# the device) and a tiny Wan base that fits it, converted by tools/convert_krea_realtime.py, then `bench live` at
# 832x480 (Krea's default size): first fragment, frames/s, a chunk's time by stage, peak memory per worker.
# Run from the repo root on the GPU machine (wheels in .whl/, see docs/gpu.md); results under $OUT.
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-500}))
W=${WORK:-/tmp/lsgpu}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
step krea-synthetic 150 python3 -m tools.convert_krea_realtime --synthetic "$W/krea-src" --layers "${LAYERS:-40}" \
  --synthetic-components "$W/krea-base"
step krea-convert 20 python3 -m tools.convert_krea_realtime "$W/krea-src" "$W/krea" --components-from "$W/krea-base"
step krea-live 240 python3 -m longserve.server.cli bench live --model "$W/krea" --size 832x480 --device cuda \
  --dtype bfloat16 --seconds 6 --memory-chunks 4,16 --no-df --json "$OUT/krea_live.json"

#!/usr/bin/env bash
# The fourth GPU session recorded in docs/gpu.md (issue 18, one engine door): the CUDA tests through the new engine
# (VideoPipeline -> VideoEngine -> EngineCore, the Wan family's hooks on diffusers' own forward), bf16 error and
# step time of the hooked forward against diffusers' own, whole videos, and the rewritten server on CUDA.
# Run from the repo root on the GPU machine (wheels in .whl/, results under $OUT); each step under its own limit,
# all inside DEADLINE_S, every step's output appended to $OUT/session.log.
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-520}))


nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, \
transformers.__version__)" 2>&1 | tee -a "$LOG"
step tests 150 python3 -m pytest -q -s -rs tests/engine/test_gpu.py -p no:cacheprovider
step numerics 90 python3 -m server.cli bench gpu --sections numerics --json "$OUT/numerics.jsonl"
step speed 150 python3 -m server.cli bench gpu --sections speed --repeats 5 --json "$OUT/speed.jsonl"
step serve-tiny 120 python3 -m server.cli bench serve --model tiny-latte --workers 1 --concurrency 1,8 --requests 8 \
  --steps 50 --json "$OUT/serve_tiny.json"
step video 200 python3 -m server.cli bench gpu --sections video --json "$OUT/video.jsonl"

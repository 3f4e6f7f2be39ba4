#!/usr/bin/env bash
# The attention-backend GPU check (issue 33 item 5, docs/gpu.md "Speed", docs/design.md "Attention backends"): the CUDA
# test of `attention_backend` (each forced SDPA kernel runs within bf16 rounding of the default, or is refused at start
# naming the field), then one Wan 1.3B-shaped step per diffusers dispatcher backend against the default. flash,
# _flash_3, sage and xformers are timed only where their packages were carried in .whl/ (else a row says why not).
# Run from the repo root on the GPU machine (wheels in .whl/, results under $OUT); about 4 minutes on one H100.
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-400}))


nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)" 2>&1 | tee -a "$LOG"
step tests 150 python3 -m pytest -q -s -rs tests/engine/test_gpu.py -k attention_backends -p no:cacheprovider
step backends 240 python3 -m server.cli bench gpu --sections backends --repeats 5 --json "$OUT/backends.jsonl"

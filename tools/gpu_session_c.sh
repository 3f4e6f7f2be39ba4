#!/usr/bin/env bash
# The third GPU session recorded in docs/gpu.md: the rows the second (tools/gpu_session_b.sh) left missing, LSS
# scoring at 131072 tokens (without transformers' own forward, which needs ~100 GiB of logits there), the tiny-latte
# server and the Wan VAE streamed untiled, then the whole videos again now that the VAE decodes untiled by default.
# Run from the repo root on the GPU machine (wheels in .whl/, results under $OUT). The steps run in that order of
# priority, each under its own time limit and all of them inside DEADLINE_S, so that one slow step cannot lose the
# others' figures; every step's output goes to $OUT/session.log (few files: the device returns at most 8).
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-520}))


nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, diffusers, transformers, fastapi, imageio_ffmpeg as f; print(torch.__version__, \
diffusers.__version__, transformers.__version__, fastapi.__version__, f.get_ffmpeg_exe())" 2>&1 | tee -a "$LOG"
SCORE="python3 -m server.cli bench score --config llama-1b --dtype bfloat16 --device cuda --workers 1 --strategies lss"
step score-32k 100 $SCORE --tokens 32768 --json "$OUT/score_32k.json"
step score-128k 150 $SCORE --tokens 131072 --no-baseline --repeat 2 --json "$OUT/score_128k.json"
step serve-tiny 240 python3 -m server.cli bench serve --model tiny-latte --workers 1 --concurrency 1,8 --requests 8 \
  --steps 50 --json "$OUT/serve_tiny.json"
step wan-vae 110 python3 -m server.cli bench gpu --sections wan-vae --step-limit-s 12 --json "$OUT/wanvae.jsonl"
step video 200 python3 -m server.cli bench gpu --sections video --json "$OUT/video.jsonl"

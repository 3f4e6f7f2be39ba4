#!/usr/bin/env bash
# The second measuring command of the GPU session recorded in docs/gpu.md (run from the repo root on the
# GPU machine, wheels in .whl/, results under $OUT). Each step has its own time limit so that one slow
# step cannot lose the others' figures.
. tools/gpu_env.sh || exit 1
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -s -rs tests/engine/test_gpu.py -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1; echo "test_gpu rc=$?"
timeout 140 python3 -m server.cli bench gpu --sections video --json "$OUT/video.jsonl" > "$OUT/video.log" 2>&1; echo "video rc=$?"
timeout 60 python3 -m server.cli bench gpu --sections wan-vae --step-limit-s 12 --json "$OUT/wanvae.jsonl" > "$OUT/wanvae.log" 2>&1; echo "wan-vae rc=$?"
timeout 95 python3 -m server.cli bench score --config llama-1b --dtype bfloat16 --device cuda --tokens 32768,131072 \
  --workers 1 --strategies lss --repeat 1 --json "$OUT/score.json" > "$OUT/score.log" 2>&1; echo "score rc=$?"
timeout 40 python3 -m server.cli bench serve --model tiny-latte --workers 1 --concurrency 1,8 --requests 8 --steps 50 \
  --json "$OUT/serve_tiny.json" > "$OUT/serve_tiny.log" 2>&1; echo "serve tiny rc=$?"
python3 -c "from pathlib import Path; from tools.bench.gpu import build_latte_dir; p = Path('/tmp/latte1'); p.mkdir(); build_latte_dir(p, False)" \
  && timeout 60 python3 -m server.cli bench serve --model /tmp/latte1 --workers 1 --concurrency 1,8 --requests 8 --steps 10 --dtype bfloat16 \
  --size 256x256 --frames 16 --json "$OUT/serve_latte1.json" > "$OUT/serve_latte1.log" 2>&1; echo "serve latte-1 rc=$?"

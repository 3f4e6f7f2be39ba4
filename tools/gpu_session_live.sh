#!/usr/bin/env bash
# Issue 41 on a GPU: live video at LongLive-1.3B's shape (832x480, 4 steps, 3-latent-frame chunks, window 12, sink 3,
# bf16, random weights), end to end (the call to the muxed fMP4 fragment), a chunk's time by stage before and after
# each lever, and 2 GPUs pipelined against 1 when two are lent. Every figure goes to docs/gpu.md with its command.
#
#   tools/gpu_session_live.sh            on the GPU machine, from the repo root (wheels in .whl/, docs/gpu.md)
#   tools/gpu_session_live.sh --tiny     on the CPU: the same steps on tiny-live at 64x64, a second of video each,
#                                        to check that every command and flag of the session runs (not a figure)
#   tools/gpu_session_live.sh --dry-run  print the steps' commands, run nothing
#
# Steps (limits in seconds; the whole session fits the 15 minutes of a lease, DEADLINE_S):
#   build            Wan 2.1 1.3B's shape and LongLive's loop (tools/weights/build_causal.py)
#   before           the serial loop with the float32 Wan VAE: the stage split the issue estimated (0.47 s VAE,
#                    0.44 s transformer of a 1.07 s chunk)
#   overlapped       the serial loop against the overlapped one (the decode on its own CUDA stream), bf16 VAE (the
#                    live default on CUDA)
#   small-decoder    the overlapped loop with a TAEHV-shaped decoder of random weights (the published one's cost)
#   compile          + regional compile of the causal blocks, then + CUDA graphs
#   two-gpus         --workers 1,2: serial, overlapped and pipelined (transformer on GPU 0, decode on GPU 1)
# The levers are issue-41-model's EngineConfig flags (--vae-dtype, --decoder, --compile, --cuda-graphs): a step
# whose flag this checkout lacks is skipped, named in the log ("no flag").
MODE=gpu
case "${1:-}" in
  --tiny) MODE=tiny ;;
  --dry-run) MODE=dry ;;
  "") ;;
  *) echo "usage: $0 [--tiny|--dry-run]" >&2; exit 2 ;;
esac

OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
LOG=$OUT/live_session.log
DEADLINE=$((SECONDS + ${DEADLINE_S:-840}))
W=${WORK:-/tmp/lsgpu}
if [ "$MODE" = gpu ]; then
  . tools/gpu_env.sh || exit 1
  PY=python3
  MODEL="$W/longlive"
  SHAPE=(--size 832x480 --device cuda --dtype bfloat16 --seconds 12)
  MEMORY=(--memory-chunks 10,60)
  GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
else
  PY=${PYTHON:-.venv/bin/python}
  MODEL=tiny-live
  SHAPE=(--size 64x64 --device cpu --seconds 1)
  MEMORY=(--memory-chunks 2,3)
  GPUS=2                                  # the two-worker step runs on two CPU workers
  step() {                                # the CPU check: run (or print) each step under `timeout`, as gpu_env.sh's
    local name=$1; shift 2
    echo "== $name: $*" | tee -a "$LOG"
    [ "$MODE" = dry ] && return
    timeout 900 "$@" >> "$LOG" 2>&1
    echo "$name rc=$?" | tee -a "$LOG"
  }
fi
# the bench's command words (an array, not a function: gpu_env.sh's `step` runs its command under `timeout`)
LIVE=($PY -m longserve.server.cli bench live --model "$MODEL" "${SHAPE[@]}" --no-df)
has_flag() { $PY -m longserve.server.cli bench live --help 2>/dev/null | grep -q -- "$1"; }
lever() {     # lever NAME LIMIT FLAG ARGS...: the step when bench live takes FLAG, else a "no flag" line
  local name=$1 limit=$2 flag=$3; shift 3
  if [ "$MODE" = dry ] || has_flag "$flag"; then step "$name" "$limit" "$@"
  else echo "$name skipped: no flag $flag in this checkout" | tee -a "$LOG"; fi
}

if [ "$MODE" = gpu ]; then
  step build-wan 100 $PY -c "import argparse; from tools.bench.gpu_wan import checkpoint; \
from tools.bench.gpu_models import build_wan_dir; \
print(checkpoint(argparse.Namespace(work_dir='$W', smoke=False), 'wan2.1-1.3b', build_wan_dir))"
  step build-longlive 80 $PY -m tools.weights.build_causal --out "$MODEL" --components-from "$W/wan2.1-1.3b" \
    --dtype bfloat16
  step build-taehv 20 $PY -m tools.weights.random_taehv -o "$W/taew2_1_random.pth"
  DECODER="$W/taew2_1_random.pth"
else
  DECODER=tiny
fi
DEV_VAE=(); [ "$MODE" = gpu ] && DEV_VAE=(--vae-dtype bfloat16)

lever before 100 --vae-dtype "${LIVE[@]}" --loops serial --vae-dtype float32 "${MEMORY[@]}" \
  --json "$OUT/live_before.json"
step overlapped 110 "${LIVE[@]}" --loops serial,overlapped "${DEV_VAE[@]}" "${MEMORY[@]}" \
  --json "$OUT/live_overlapped.json"
lever small-decoder 80 --decoder "${LIVE[@]}" --loops serial,overlapped --decoder "$DECODER" --memory-chunks 10 \
  --json "$OUT/live_small_decoder.json"
if [ "$MODE" = gpu ]; then
  lever compile 150 --compile "${LIVE[@]}" --loops overlapped "${DEV_VAE[@]}" --compile blocks --memory-chunks 10 \
    --json "$OUT/live_compile.json"
  lever cuda-graphs 150 --cuda-graphs "${LIVE[@]}" --loops overlapped "${DEV_VAE[@]}" --compile blocks --cuda-graphs \
    --memory-chunks 10 --json "$OUT/live_cuda_graphs.json"
fi
if [ "$GPUS" -ge 2 ]; then
  step two-gpus 200 "${LIVE[@]}" --workers 1,2 --loops serial,overlapped,pipelined "${DEV_VAE[@]}" "${MEMORY[@]}" \
    --json "$OUT/live_two_gpus.json"
else
  echo "two-gpus skipped: $GPUS GPU(s) lent" | tee -a "$LOG"
fi
echo "log: $LOG; rows: $OUT/live_*.json"

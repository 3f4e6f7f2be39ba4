# Source on a GPU machine that cannot reach a package index: installs the wheels carried in .whl/
# (diffusers, transformers, fastapi, ... at the versions of the CPU .venv) into /tmp/site and puts
# them and the repository on PYTHONPATH. See docs/gpu.md.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
# imageio-ffmpeg's wheel (a 173 MB ffmpeg, 68 MB zipped) alone is more than a call may carry (64 MiB): .whl/ then
# holds that wheel without its binary and an xz-compressed static ffmpeg (.whl/ffmpeg-*.xz), used through
# IMAGEIO_FFMPEG_EXE (imageio_ffmpeg.get_ffmpeg_exe() looks there first).
for xz in .whl/ffmpeg-*.xz; do
  [ -e "$xz" ] || continue
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$xz" /tmp/site/ffmpeg && chmod +x /tmp/site/ffmpeg || return 1
  export IMAGEIO_FFMPEG_EXE=/tmp/site/ffmpeg
done
# the one import name, `longserve`, mapped onto the repository's folders as pyproject.toml's package-dir does
# (an editable install without pip): ./longserve/{engine,pipelines,server,weights} -> ./engine, ... in this copy of
# the repository (python -m and -c put the working directory first on sys.path, so it must be this folder)
for pkg in engine pipelines server weights; do ln -sfn "$PWD/$pkg" "longserve/$pkg" || return 1; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
longserve() { python3 -m longserve.server.cli "$@"; }

# step NAME LIMIT_S COMMAND...: COMMAND under min(LIMIT_S, the time left before $DEADLINE (in $SECONDS)), its output
# appended to $LOG, its exit status and time to the terminal: the session scripts (tools/gpu_session_*.sh) are steps
step() {
  local name=$1 limit=$2 t=$SECONDS; shift 2
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "$name skipped (${left} s left)" | tee -a "$LOG"; return; fi
  echo "== $name (limit $limit s): $*" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "$name rc=$? $((SECONDS - t)) s" | tee -a "$LOG"
}

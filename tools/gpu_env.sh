# Source on a GPU machine that cannot reach a package index: installs the wheels carried in .whl/
# (diffusers, transformers, fastapi, ... at the versions of the CPU .venv) into /tmp/site and puts
# them and the repository on PYTHONPATH. See docs/gpu.md.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
longserve() { python3 -m server.cli "$@"; }

# longserve developer entry points. Every target works from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of this torch release lies on the dev/CI machines' disk; on a GPU
# machine the same pin resolves to the CUDA wheel from PyPI.
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test lint fmt demo demo-long demo-live demo-i2v screenshots bench docker clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench,lint]'
	touch $(STAMP)

# the suite: under 8 minutes of pytest on a quiet 2-core machine (docs/test_durations.md has the table). Two
# pytest processes (pytest-xdist), each file's tests kept together so module fixtures are made once: much of
# the suite waits on process starts, imports and sockets, one core each, and the other process fills the gap.
# Bytecode is written (an empty PYTHONDONTWRITEBYTECODE: CI's machines set it, and every process then compiled
# longserve, and pytest re-rewrote its plugins' modules, from source); files in the order of tests/conftest.py's
# LONGEST_FIRST (--no-loadscope-reorder)
test: install
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# style gate (run first by .ci/run): pyflakes, pycodestyle, import order, bugbear ([tool.ruff] in pyproject.toml)
lint: install
	$(VENV)/bin/ruff check .

# ruff's own fixes of what lint finds (import order, unused imports); the code is not run through a
# reformatter: its aligned shape comments are part of the style
fmt: install
	$(VENV)/bin/ruff check --fix .

# "a red ball bouncing" at tiny-latte's defaults (trained on procedural clips: weights/README.md), and a strip
# of its frames; docs/demo_strip.png (shown in README.md) is a copy of out/demo_strip.png (tests/pipelines/test_content.py)
demo: install
	mkdir -p out
	$(VENV)/bin/longserve generate "a red ball bouncing" --model tiny-latte --workers 2 --seed 0 --overwrite -o out/demo.mp4
	$(PY) -m tools.frame_strip out/demo.mp4 -o out/demo_strip.png --scale 2

# a 30 s live video on tiny-live (a trained causal few-step model: weights/README.md) whose prompt switches from
# "a red ball bouncing" to "a blue ball bouncing" at 15 s; docs/demo_live_strip.png (README.md) shows the switch
# DECODER=tiny: the frames through tiny-live's small TAEHV-shaped decoder instead of its VAE (weights/README.md)
DECODER ?= vae
demo-live: install
	mkdir -p out
	$(PY) -m tools.live_demo --model tiny-live --seconds 30 --switch-at 15 -o out/demo_live.mp4 \
		--strip out/demo_live_strip.png --chunks-json out/demo_live_chunks.json --decoder $(DECODER)

# long video by diffusion forcing on tiny-skyreels-df (trained on procedural clips: weights/README.md): "a red ball
# bouncing", 89 frames = 10 segments of 17 frames, each given the last 9 of the one before, written as they are made;
# docs/demo_long_strip.png (README.md) shows one frame a segment (tests/pipelines/test_long_content.py)
demo-long: install
	mkdir -p out
	$(VENV)/bin/longserve generate "a red ball bouncing" --model tiny-skyreels-df --workers 2 \
		--frames 89 --base-frames 17 --overlap 9 --size 64x64 --steps 10 --seed 0 --overwrite -o out/demo-long.mp4
	$(PY) -m tools.frame_strip out/demo-long.mp4 -o out/demo_long_strip.png --segments 17,9 --scale 2

# image-to-video on tiny-i2v (trained to continue a first frame: weights/README.md): a red ball drawn at the left,
# continued as "a red ball moving right"; docs/demo_i2v_strip.png (README.md) is the strip (tests/pipelines/test_i2v_content.py)
demo-i2v: install
	mkdir -p out
	$(PY) -m tools.ball_image red --x 16 --y 32 -o out/red_ball.png
	$(VENV)/bin/longserve generate "a red ball moving right" --model tiny-i2v --image out/red_ball.png --workers 2 \
		--seed 0 --overwrite -o out/demo_i2v.mp4
	$(PY) -m tools.frame_strip out/demo_i2v.mp4 -o out/demo_i2v_strip.png --scale 2

# the page's pictures (README.md, docs/serving.md): the browser tests save them to out/ui/ (tests/support/browser.py,
# needs chromium: .ci/run installs it); docs/ui_video.png and docs/ui_live.png are copies
screenshots: install
	$(PY) -m pytest -q -p no:randomly tests/server/test_ui_video.py tests/server/test_ui_live.py
	cp out/ui/ui_video.png out/ui/ui_live.png out/ui/ui_video_phone.png out/ui/ui_live_phone.png \
		out/ui/ui_live_recorded.png docs/

bench: install
	$(VENV)/bin/longserve bench transformer --strategies dsp,ulysses,ring,megatron-sp \
		--workers 1,2,4 --json docs/bench_transformer.json --plot docs/bench_transformer.png

docker:
	docker build -t longserve:latest .

clean:
	rm -rf $(VENV) out .pytest_cache

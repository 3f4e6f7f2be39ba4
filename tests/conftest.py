"""Fixtures every test tree shares.

- The suite runs offline: no model hub is ever asked (`HF_HUB_OFFLINE` and friends are set
  for this process and every worker it starts); the `offline` fixture also refuses any
  network connection during a test, to prove a code path never tries one.
- One intra-op thread per process: `make test` runs two pytest processes on two cores, and each
  worker pool, server process and diffusers reference beside them; torch's default (a thread per
  core in every process) oversubscribes the cores, and GNU OpenMP's threads then wait on each
  other (a diffusers comparison ran 3-4x slower, measured beside the other pytest process).
  `OMP_NUM_THREADS=1` (unless set) reaches this process's torch and every process it starts; CPU
  worker pools take their threads from it (`engine/pool.py`). `one_thread` is kept for a test
  that must pin it whatever the environment.
- Bytecode is written and read even where the environment sets `PYTHONDONTWRITEBYTECODE` (CI's machines do):
  without it each of the suite's ~60 Python processes (servers, fork servers, CLI runs, torchrun ranks) compiled
  longserve's modules from source, and each pytest process re-rewrote the 390 test modules' asserts (1.2 and 5
  CPU-s apiece on a 2-core AMD EPYC). The caches land in `__pycache__/` folders, which git ignores.
- Worker pools and pipelines are expensive to start (a process per worker, each importing
  torch and diffusers and loading a model), so tests that only *read* share them:
  `bare_pool4` (four gloo workers with no model, for forward-level tests that build their own
  sub-groups) and `pipeline(model, **options)` (a session cache of `VideoPipeline`s keyed by
  their options, at most a few alive at once). A test that breaks or reconfigures a pool
  (kills a worker, switches the plan) makes its own.
- `http_client(url)` is an httpx client closed after the test; `tests/support/servers.py`'s
  `serving(data_dir, **options)` starts an in-process server (`VideoService` + uvicorn on a
  free port) for the modules that need their own.
"""

from __future__ import annotations

import collections
import os
import socket
import sys

import pytest

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DIFFUSERS_OFFLINE": "1"}
os.environ.update(OFFLINE)          # before anything imports huggingface_hub; inherited by spawned workers
os.environ.setdefault("OMP_NUM_THREADS", "1")         # before anything imports torch (the docstring)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # idle OpenMP threads sleep: never changes a result
# Bytecode is cached (the docstring): with PYTHONDONTWRITEBYTECODE set, every process compiled longserve from source
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

#: how many shared pipelines stay alive at once (each holds `workers` processes)
PIPELINE_CACHE_SIZE = 3


@pytest.fixture
def offline(monkeypatch):
    """No hub, no network: the offline flags (set for the session above) plus a guard on every socket connect."""
    for var, value in OFFLINE.items():
        monkeypatch.setenv(var, value)
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)
    real_connect = socket.socket.connect

    def guarded_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"network access attempted in an offline test: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)


@pytest.fixture
def one_thread():
    """One intra-op thread in this process: two fighting other processes' threads on 2 cores run far slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bare_pool4():
    """Four gloo workers with no model: forward-level tests build their sub-groups in `ctx.state`."""
    from longserve.engine.pool import WorkerPool

    with WorkerPool(4, device="cpu") as pool:
        yield pool


class PipelineCache:
    """`VideoPipeline`s shared across the session, by their options; the least recently used is closed when
    more than `size` are alive."""

    def __init__(self, size: int):
        self.size = size
        self._open: collections.OrderedDict = collections.OrderedDict()

    def get(self, model: str, **options):
        from longserve.pipelines import VideoPipeline

        options.setdefault("device", "cpu")
        key = (model, tuple(sorted(options.items())))
        pipe = self._open.pop(key, None)
        if pipe is None or not pipe.engine.stats().loop_alive:
            pipe = VideoPipeline.from_pretrained(model, **options)
        self._open[key] = pipe
        while len(self._open) > self.size:
            _, old = self._open.popitem(last=False)
            old.close()
        return pipe

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


@pytest.fixture(scope="session")
def pipeline_cache():
    cache = PipelineCache(PIPELINE_CACHE_SIZE)
    yield cache
    cache.close()


@pytest.fixture
def pipeline(pipeline_cache):
    """`pipeline("tiny-latte", workers=2)`: a shared, started pipeline. Do not close it or change its plan."""
    return pipeline_cache.get


@pytest.fixture
def http_client():
    """`http_client(url)`: an httpx client with a generous timeout, closed after the test."""
    import httpx

    clients = []

    def make(url: str, **kwargs):
        kwargs.setdefault("timeout", 60)
        client = httpx.Client(base_url=url, **kwargs)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


#: the longest test files (the mean of wall and CPU-seconds, measured a file at a time in one `pytest -n 1` run on a
#: 2-core AMD EPYC: docs/test_durations.md), run first: `make test`
#: hands whole files to its two pytest processes in collection order (`--no-loadscope-reorder`: xdist's default
#: sorts files by their number of tests, which ran this list's order nowhere), so a long file collected last leaves
#: one process working alone at the end
LONGEST_FIRST = (
    "server/test_replicas.py", "test_readme.py", "pipelines/test_compile.py", "server/test_shared_store.py",
    "pipelines/test_content.py", "pipelines/test_video_pipeline.py", "server/bench/test_bench_gpu.py",
    "pipelines/test_live_content.py", "pipelines/test_wan_pipeline.py", "pipelines/test_hunyuan15_pipeline.py",
    "server/test_serve_process.py", "engine/test_comm.py", "server/test_api.py", "server/test_cli.py",
    "pipelines/test_ltx2_pipeline.py", "server/test_api_requests.py", "server/test_api_long_video.py",
    "pipelines/test_live_video.py", "server/test_ui_live.py", "server/test_fair_edge.py",
    "pipelines/test_long_video.py", "server/test_extend_api.py", "server/test_live_api.py",
    "weights/test_tiny_live.py", "engine/test_causal_vae.py", "server/bench/test_bench_speed.py",
    "pipelines/test_helios_pipeline.py", "server/test_drain.py", "pipelines/test_helios_pyramid_pipeline.py",
    "pipelines/test_step_cache.py", "pipelines/test_sana_video_pipeline.py", "weights/test_train_tiny_skyreels_df.py",
    "pipelines/test_scoring.py", "server/test_image_to_video.py", "weights/test_wan.py",
    "pipelines/test_wan_i2v_pipeline.py", "pipelines/test_long_content.py", "weights/test_train_tiny_latte.py",
    "pipelines/test_wan22_i2v_pipeline.py", "pipelines/test_extend_video.py",
)


def pytest_collection_finish(session):
    """Every module the tests import is imported now: freeze that heap, so that the collector's full passes (dozens a
    run) scan only what the tests make."""
    from longserve.engine.startup import freeze_heap

    freeze_heap()


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """This process's fork server, forked from it at the first test (engine/zygote.py: else each pytest process
    launched one that imported torch, diffusers and transformers again). Inside a test's capture, so that what
    workers write to stdout and stderr lands in the report of the test that runs then, as it did before. The one other
    thread here is pytest-xdist's channel reader, blocked on its pipe: the copy never uses it."""
    from longserve.engine.startup import prestart

    prestart("cpu", threads_ok=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)          # stable: the other files, and the tests within a file, keep their order

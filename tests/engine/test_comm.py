"""Collectives: shapes, padding of uneven sizes, and exact byte accounting, on gloo."""

import os

import pytest
import torch

from longserve.engine import comm
from longserve.engine.pool import WorkerError, WorkerPool


def _roundtrip_switch(ctx, full):
    """Shard dim 1, switch to dim 2 and back; return every intermediate this rank saw."""
    pg = ctx.pg
    comm.STATS.reset()
    local = comm.shard(full, 1, pg)                                     # (B, ceil(T/N), S, C)
    switched = comm.all_to_all_switch(local, 2, 1, full.shape[1], pg)   # (B, T, ceil(S/N), C)
    back = comm.all_to_all_switch(switched, 1, 2, full.shape[2], pg)    # (B, ceil(T/N), S, C)
    whole = comm.gather(back, 1, full.shape[1], pg)                     # (B, T, S, C)
    return local, switched, whole, comm.STATS.snapshot()


def _reduce_scatter_and_ring(ctx, x):
    pg = ctx.pg
    comm.STATS.reset()
    partial = x * (pg.rank + 1)
    rs = comm.reduce_scatter(partial, 0, pg)
    ring = comm.ring_shift(torch.full((3,), float(pg.rank)), pg)
    return rs, ring, comm.STATS.snapshot()


def _gather_to(ctx, dst):
    comm.STATS.reset()
    got = comm.gather_to(torch.full((2, 3), float(ctx.pg.rank)), dst, ctx.pg)
    return got, comm.STATS.snapshot()


def _fail_on(ctx, bad_rank, error="input"):
    """Fail on `bad_rank` (None: every rank) before any collective: an input error, or a library's ValueError."""
    from longserve.engine.request import RequestError

    if bad_rank is None or ctx.pg.rank == bad_rank:
        raise RequestError("num_frames", "num_frames must be positive") if error == "input" else \
            ValueError("a library's check deep inside a forward")
    return ctx.pg.rank


def _sum_of_ranks_then_fail(ctx, bad_rank, how):
    """Rank `bad_rank` fails (`how`) *before* the all-reduce its peers enter: they are left waiting in it."""
    if ctx.pg.rank == bad_rank:
        if how == "raise":
            raise RuntimeError("a bug on one rank")
        if how == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if how == "exit":
            os._exit(3)
    return comm.all_reduce(torch.tensor([float(ctx.pg.rank)]), ctx.pg)


def _sum_of_ranks(ctx, offset):
    return comm.all_reduce(torch.tensor([float(ctx.pg.rank + offset)]), ctx.pg).item()


@pytest.fixture(scope="module")
def pool3():
    with WorkerPool(3, device="cpu") as pool:
        yield pool


def test_switch_pads_odd_frames_and_patches_and_roundtrips(pool3):
    full = torch.randn(2, 13, 35, 4)  # T=13, S=35: neither divides by 3
    out = pool3.run(_roundtrip_switch, full)
    for rank, (local, switched, whole, stats) in enumerate(out):
        t0 = rank * 5
        want_local = torch.nn.functional.pad(full, (0, 0, 0, 0, 0, 2))[:, t0:t0 + 5]
        assert torch.equal(local, want_local)
        s0 = rank * 12
        want_switched = torch.nn.functional.pad(full, (0, 0, 0, 1))[:, :, s0:s0 + 12]
        assert torch.equal(switched, want_switched)
        assert torch.equal(whole, full)
        # two all-to-alls of (2, 5, 36, 4) and (2, 13->15, 12, 4) fp32 tensors, 2/3 sent each
        a2a = (2 * 5 * 36 * 4 + 2 * 15 * 12 * 4) * 4 * 2 / 3
        ag = 2 * (2 * 5 * 35 * 4) * 4
        assert stats["calls"] == {"all_to_all": 2, "all_gather": 1}
        assert stats["bytes_sent"] == round(2 * 5 * 36 * 4 * 4 * 2 / 3) + round(2 * 15 * 12 * 4 * 4 * 2 / 3) + ag
        assert abs(stats["bytes_sent"] - (a2a + ag)) <= 2


def test_reduce_scatter_sums_partials_and_ring_shifts(pool3):
    x = torch.randn(7, 2)
    out = pool3.run(_reduce_scatter_and_ring, x)
    total = x * (1 + 2 + 3)
    padded = torch.nn.functional.pad(total, (0, 0, 0, 2))
    for rank, (rs, ring, stats) in enumerate(out):
        torch.testing.assert_close(rs, padded[rank * 3:(rank + 1) * 3])
        assert torch.equal(ring, torch.full((3,), float((rank - 1) % 3)))
        assert stats["calls"] == {"reduce_scatter": 1, "send_recv": 1}


def test_gather_to_stacks_every_rank_on_dst_only_and_counts_what_others_send(pool3):
    out = pool3.run(_gather_to, 1)
    for rank, (got, stats) in enumerate(out):
        assert stats["calls"] == {"gather": 1}
        if rank == 1:
            assert torch.equal(got, torch.arange(3.0).view(3, 1, 1).expand(3, 2, 3))
            assert stats["bytes_sent"] == 0  # dst keeps its own row
        else:
            assert got is None
            assert stats["bytes_sent"] == 2 * 3 * 4


def test_an_input_error_on_every_rank_before_any_collective_keeps_the_pool(pool3):
    restarts = pool3.restarts
    with pytest.raises(WorkerError, match="num_frames") as e:
        pool3.run(_fail_on, None)
    assert (e.value.kind, e.value.field) == ("input", "num_frames")
    assert pool3.restarts == restarts, "nothing is pending anywhere: the group is in step"
    assert pool3.run(_fail_on, -1) == [0, 1, 2]


def test_a_library_value_error_is_an_internal_error_and_restarts_the_pool(pool3):
    restarts = pool3.restarts
    with pytest.raises(WorkerError, match="deep inside") as e:
        pool3.run(_fail_on, None, "library")
    assert e.value.kind == "internal", "only the request's own input error is the client's fault"
    assert pool3.restarts == restarts + 1


def test_an_input_error_on_one_rank_restarts_the_pool(pool3):
    restarts = pool3.restarts
    with pytest.raises(WorkerError, match="num_frames"):
        pool3.run(_fail_on, 1)
    assert pool3.restarts == restarts + 1
    assert pool3.run(_fail_on, -1) == [0, 1, 2]


@pytest.mark.parametrize("how, kind", [("raise", "internal"), ("oom", "out_of_memory"), ("exit", "worker_died")])
def test_a_failure_on_one_rank_never_leaves_a_collective_for_the_next_job(pool3, how, kind):
    """Rank 1 fails while ranks 0 and 2 wait for it in an all-reduce. Had the pool not been restarted, the
    next job's all-reduce on rank 1 would meet its peers' pending one and mix the two jobs' values."""
    restarts = pool3.restarts
    pool3.error_grace_s = 1.0                # how long the pool waits for ranks 0 and 2, stuck in the all-reduce
    with pytest.raises(WorkerError) as e:
        pool3.run(_sum_of_ranks_then_fail, 1, how)
    assert (e.value.kind, e.value.rank) == (kind, 1), str(e.value)
    assert pool3.restarts == restarts + 1
    assert pool3.run(_sum_of_ranks, 10) == [33.0, 33.0, 33.0], "10 + 11 + 12 on every rank: nothing mixed in"


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return " Z " not in state and "zombie" not in state


def _wait_dead(pids, timeout=15.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_close_leaves_no_worker_processes():
    pool = WorkerPool(2, device="cpu").start()
    pids = pool.pids
    assert all(_alive(p) for p in pids)
    pool.close()
    assert _wait_dead(pids) == []


def test_workers_exit_when_their_coordinator_is_killed():
    import signal
    import subprocess
    import sys

    code = ("from engine.pool import WorkerPool\n"
            "import time\n"
            "pool = WorkerPool(2, device='cpu').start()\n"
            "print(' '.join(map(str, pool.pids)), flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)  # no atexit, no close(): the workers must notice on their own
        proc.wait(timeout=10)
        assert _wait_dead(pids) == []
    finally:
        proc.kill()


def test_under_torchrun_a_failing_non_zero_rank_surfaces_on_rank_0_instead_of_hanging(tmp_path):
    import json
    import subprocess
    import sys

    from longserve.engine.dist import find_free_port

    out = tmp_path / "result.json"
    # torchrun's agent stops every rank monitor-interval (default 0.1 s) after rank 1 exits: at a load of 7 that
    # came before rank 0 had written its report; the test gives rank 0 time to report (it must still not hang)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(find_free_port()), "--monitor-interval", "10",
           os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "torchrun_failure.py"),
           str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.exists(), f"rank 0 wrote no result; torchrun exited {run.returncode}:\n{run.stdout[-3000:]}\n" \
                         f"{run.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["first_job"] == 3.0
    assert result["raised"] and (result["kind"], result["rank"]) == ("internal", 1), result
    assert "rank 1 broke" in result["message"]
    assert result["seconds"] < 10 and result["state"] == "unavailable"
    assert "rank 1 failed in sum_then_fail_on_rank_1" in run.stderr and "rank 1 broke" in run.stderr


def _accounted_and_real_bytes(ctx, n):
    """{kind: (bytes engine.comm accounts for, bytes this process really wrote to its sockets)} per collective."""
    def written():  # bytes passed to write()/send() by this process: gloo's sockets, nothing else runs here
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("wchar")).split()[1])

    N = ctx.pg.world_size
    x = torch.randn(n * N)
    calls = {"all_to_all": lambda: comm.all_to_all_switch(x.view(N, -1), 0, 1, n, ctx.pg),
             "all_gather": lambda: comm.all_gather(x[:n], 0, ctx.pg),
             "reduce_scatter": lambda: comm.reduce_scatter(x, 0, ctx.pg),
             "all_reduce": lambda: comm.all_reduce(x[:n], ctx.pg),
             "send_recv": lambda: comm.ring_shift(x[:n], ctx.pg),
             "gather": lambda: comm.gather_to(x[:n], 0, ctx.pg)}
    out = {}
    for kind, call in calls.items():
        comm.STATS.reset()
        before = written()
        call()
        out[kind] = (comm.STATS.bytes_sent, written() - before)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's per-process I/O counters")
def test_the_accounted_bytes_are_the_bytes_the_backend_really_sends(pool3):
    n = 1 << 19                                               # 2 MiB of float32 per rank chunk
    for rank, got in enumerate(pool3.run(_accounted_and_real_bytes, n)):
        for kind, (accounted, real) in got.items():
            if kind == "reduce_scatter":
                # engine.comm accounts for the ring algorithm NCCL runs, (N-1)/N of the input; gloo sends twice that
                assert abs(real - 2 * accounted) <= 4096, (rank, kind, accounted, real)
            else:
                assert abs(real - accounted) <= 4096, (rank, kind, accounted, real)   # headers: about 1 KiB
        assert got["all_to_all"][0] == round(4 * n * 3 * 2 / 3), "the formula itself: (N-1)/N of the input"


def test_a_worker_whose_sentinel_reads_dead_is_still_alive_by_its_pid_and_killed_by_it():
    """Workers forked by the fork server report through it; if it dies, their sentinels read dead. The pool
    then asks the processes themselves (and kills them by pid), so no live worker is left behind."""
    import signal
    import subprocess

    from longserve.engine.pool import _alive, _pid_running

    proc = subprocess.Popen(["sleep", "30"])

    class Sentinel:             # what a forked worker's Process looks like once its fork server is gone
        pid = proc.pid

        @staticmethod
        def is_alive():
            return False

    try:
        assert _alive(Sentinel) and _pid_running(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert not _alive(Sentinel) and not _pid_running(proc.pid)
    finally:
        proc.kill()


def test_the_fork_server_is_prestarted_only_where_this_process_will_fork_workers(monkeypatch):
    from longserve.engine.startup import prestart, start_method

    assert (start_method("cpu"), start_method("cuda"), start_method("cuda:1")) == ("forkserver", "spawn", "spawn")
    assert prestart("cuda") is False, "CUDA workers are spawned"
    assert prestart("cpu", launcher="torchrun") is False, "a torchrun group has no local workers"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert prestart("cpu") is False
    monkeypatch.delenv("RANK")
    assert prestart("cpu") is True


def test_workers_never_run_the_callers_main_module(tmp_path):
    """A script with no main guard, read from stdin (`python -`), starts a worker process as a CUDA pool does
    (spawn): the child runs engine/worker_main.py as `__main__`, and the script itself runs once (before, the child
    re-ran the caller's script, here failing on '<stdin>'). The forkserver path (CPU pools) is run for real by
    tests/test_readme.py's snippets, as files with no guard; the fork server's imports make it too slow here."""
    import subprocess
    import sys

    script = (
        "from longserve.engine.startup import context\n"
        "print('script ran', flush=True)\n"
        "code = \"import sys; print('child main', sys.modules['__main__'].__spec__.name, flush=True)\"\n"
        "for device in ('cuda',):\n"
        "    p = context(device).Process(target=exec, args=(code,))\n"
        "    p.start(); p.join(60)\n"
        "    print(device, p.exitcode, flush=True)\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    expected = ["script ran", "child main longserve.engine.worker_main", "cuda 0"]
    assert out.stdout.splitlines() == expected, out.stdout + out.stderr


def _frozen_objects(ctx):
    import gc

    return gc.get_freeze_count()


def test_workers_start_with_the_fork_servers_imports_frozen_out_of_the_collector(pool3):
    """engine/preload.py freezes what it imported before the forks: a worker's collections neither scan those
    objects nor write to their pages (shared with the fork server). Without it a worker's count is 0."""
    counts = pool3.run(_frozen_objects)
    assert len(counts) == 3 and min(counts) > 100_000, counts       # torch, diffusers, transformers: ~10^6

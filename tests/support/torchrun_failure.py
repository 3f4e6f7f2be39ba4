"""Run under torchrun by tests/engine/test_comm.py: rank 1 raises inside a job while its peers wait for it in a
collective; rank 0 must get a WorkerError naming rank 1 (not hang), and report what it saw as JSON."""

import json
import os
import sys
import time

import torch

from longserve.engine import comm
from longserve.engine.pool import TorchrunPool, WorkerError


def sum_of_ones(ctx):
    return comm.all_reduce(torch.ones(1), ctx.pg).item()


def sum_then_fail_on_rank_1(ctx):
    total = comm.all_reduce(torch.ones(1), ctx.pg)                 # everyone in step
    if ctx.pg.rank == 1:
        raise RuntimeError("rank 1 broke")
    return comm.all_reduce(total, ctx.pg).item()                   # ranks 0 and 2 wait here for rank 1


if __name__ == "__main__":
    out_path = sys.argv[1]
    pool = TorchrunPool(device="cpu")                              # ranks 1 and 2 serve from here on
    ok = pool.run(sum_of_ones)[0]                                  # a healthy job first
    t0 = time.monotonic()
    try:
        pool.run(sum_then_fail_on_rank_1)
        result = {"raised": False}
    except WorkerError as e:
        result = {"raised": True, "kind": e.kind, "rank": e.rank, "message": str(e)[:400]}
    result.update(seconds=time.monotonic() - t0, first_job=ok, state=pool.state)
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)                                                    # the group is broken: no orderly teardown

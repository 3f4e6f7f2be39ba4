"""`longserve bench live` on tiny-live (docs/gpu.md section 7 is this command at LongLive's shape): a live row per
loop, its first fragment, rate and a chunk's time by stage (transfer included) and overlap, flat memory rows and the
switch row, in its JSON."""

import json

import pytest

from longserve.server.cli import main


def test_bench_live_reports_a_chunk_s_time_by_stage_flat_memory_and_the_switch(tmp_path):
    out = tmp_path / "live.json"
    assert main(["bench", "live", "--model", "tiny-live", "--seconds", "1.5", "--memory-chunks", "2,4", "--no-df",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    lives = [r for r in rows if r["kind"] == "live"]
    assert [(r["workers"], r["loop"]) for r in lives] == [(1, "serial"), (1, "overlapped")]   # the default loops
    live = lives[0]
    assert live["chunks"] >= 4 and 0 < live["first_fragment_s"] < live["seconds"] and live["fps"] > 0
    stages = [live[f"{k}_ms_per_chunk"] for k in ("transformer", "vae", "transfer", "mux")]
    assert all(s > 0 for s in stages)                                  # each stage was timed
    wall = 1000 * live["seconds"] / live["chunks"]
    assert sum(live[f"{k}_ms_per_chunk"] for k in ("transformer", "vae", "transfer", "rest")) == \
        pytest.approx(wall)                                            # the worker's stages and the rest: the wall
    assert live["rest_ms_per_chunk"] >= -0.05 * wall                   # serial: the stages fit in the wall time
    # (overlap counts the caller's muxer too, which runs beside the workers' next chunk even in the serial loop)
    assert live["overlap"] > 0 and lives[1]["vae_ms_per_chunk"] > 0 and lives[1]["vs_serial_1"] > 0
    memory = [r for r in rows if r["kind"] == "memory"]
    assert [(r["loop"], r["chunks"]) for r in memory] == [("serial", 2), ("serial", 4), ("overlapped", 2),
                                                           ("overlapped", 4)]
    assert all(r["vs_first"] < 1.2 for r in memory)                    # flat in either loop
    switch = next(r for r in rows if r["kind"] == "prompt switch")
    assert switch["switch_chunks"] <= 1

"""`longserve bench long` runs end to end: longserve rows per worker count and segment count, diffusers' rows."""

import json

from longserve.server.cli import main
from tools.bench.long import frames_for


def test_frames_for_gives_the_frames_that_make_that_many_segments():
    assert [frames_for(s, 17, 9) for s in (1, 3, 9)] == [17, 33, 81]
    assert frames_for(2, 97, 17) == 177


def test_bench_long_reports_longserve_and_diffusers_with_memory_per_worker(tmp_path):
    out = tmp_path / "long.json"
    assert main(["bench", "long", "--workers", "2", "--segments", "1,2", "--steps", "1", "--size", "64x64",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["impl"], r["workers"], r["segments"]) for r in rows] == [
        ("longserve", 2, 1), ("longserve", 2, 2), ("diffusers (one shot)", 1, 1), ("diffusers (one shot)", 1, 2)]
    for r in rows:
        assert r["frames"] == frames_for(r["segments"], 17, 9)
        assert r["peak_bytes"] > 0 and 0 < r["first_frame_s"] <= r["seconds"]
    longserve = [r for r in rows if r["impl"] == "longserve"]
    assert all(len(r["peak_bytes_per_worker"]) == 2 for r in longserve)

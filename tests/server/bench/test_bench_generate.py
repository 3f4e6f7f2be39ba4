"""`longserve bench generate`: seconds per video and the pool's overhead, one row per (config, workers, steps per
job), with the engine's own flags (generated from EngineConfig) applied to every point."""

import json

from longserve.server.cli import main


def test_bench_generate_writes_a_row_per_point_with_the_engine_flags_applied(tmp_path):
    out = tmp_path / "generate.json"
    assert main(["bench", "generate", "--configs", "tiny", "--workers", "1,2", "--steps", "2", "--runs", "1",
                 "--steps-per-job", "2", "--parallel", "ulysses", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["config"], r["workers"], r["steps_per_job"], r["plan"]) for r in rows] == \
        [("tiny", 1, 2, "ulysses"), ("tiny", 2, 2, "ulysses")]
    for r in rows:
        assert r["video_s"] >= r["transformer_s"] > 0 and r["vae_s"] > 0

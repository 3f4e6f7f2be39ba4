"""`longserve bench speed` end to end, small: an exact row and a step-caching row over the same videos, with
block evaluations, wall time, PSNR against exact and the recognition count on the trained tiny-latte."""

import json

from server.cli import main


def test_bench_speed_reports_exact_and_each_cache_setting(tmp_path):
    out = tmp_path / "speed.json"
    assert main(["bench", "speed", "--prompts", "2", "--steps", "6", "--frames", "4", "--cache",
                 '{"kind": "first_block", "threshold": 0.3}', "--json", str(out)]) == 0
    exact, cached = json.loads(out.read_text())
    assert exact["lever"] == "exact" and exact["psnr_db"] is None and exact["fewer_blocks"] == 1.0
    assert exact["blocks_per_video"] == 6 * 2 * 6 and exact["blocks_skipped_per_video"] == 0
    assert cached["cache"] == {"kind": "first_block", "threshold": 0.3}
    assert cached["blocks_per_video"] + cached["blocks_skipped_per_video"] == 6 * 2 * 6
    assert cached["fewer_blocks"] > 1 and 0 < cached["psnr_db"] < 100
    assert cached["wall_s"] > 0 and cached["speedup"] > 0
    assert 0 <= cached["recognised"] <= 2 and exact["videos"] == cached["videos"] == 2


def test_bench_speed_calibrates_a_mag_cache_the_checkpoint_has_no_ratios_for(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["bench", "speed", "--model", "tiny-wan", "--prompts", "1", "--steps", "6", "--frames", "5",
                 "--cache", '{"kind": "mag", "threshold": 0.5}', "--json", str(out)]) == 0
    exact, mag = json.loads(out.read_text())
    assert "mag cache calibrated" in capsys.readouterr().err
    assert len(mag["cache"]["mag_ratios"]) == 6 and mag["cache"]["mag_ratios"][0] == 1.0
    assert "mag_ratios" not in mag["lever"] and exact["recognised"] is None
    assert mag["blocks_per_video"] + mag["blocks_skipped_per_video"] == exact["blocks_per_video"]

"""`longserve bench speed` end to end, small: an exact row and a step-caching row over the same videos, with
block evaluations, wall time, PSNR against exact and the recognition count on the trained tiny-latte."""

import json

import pytest

from longserve.server.cli import main


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


def test_bench_speed_adds_a_compile_row_and_a_stack_row_with_the_compile_time(tmp_path):
    """The rows' mechanism at the smallest size, with the eager backend (dynamo's graphs run as they are traced:
    inductor's code generation would take minutes on this CPU; the inductor figures are docs/design.md's)."""
    out = tmp_path / "speed.json"
    assert main(["bench", "speed", "--prompts", "1", "--steps", "3", "--frames", "2", "--compile", "blocks",
                 "--compile-backend", "eager", "--cache", '{"kind": "first_block", "threshold": 0.3}',
                 "--json", str(out)]) == 0
    exact, cached, compiled, stack = json.loads(out.read_text())
    assert [r["lever"] for r in (exact, compiled)] == ["exact", "compile blocks"]
    assert stack["lever"] == "compile blocks + cache kind=first_block, threshold=0.3"
    assert exact["compile_s"] is None and compiled["compile_s"] > 0 and stack["compile_s"] == compiled["compile_s"]
    assert compiled["blocks_per_video"] == exact["blocks_per_video"] and compiled["psnr_db"] > 60
    assert stack["blocks_per_video"] == cached["blocks_per_video"] and stack["wall_s"] > 0
    assert stack["psnr_db"] == pytest.approx(cached["psnr_db"], abs=1)        # inf when nothing was skipped


def test_bench_speed_profile_fast_reports_each_lever_the_whole_profile_and_diffusers(tmp_path):
    """On a CPU the fast profile's levers for tiny-latte are the request levers (step caching, CFG truncation): a row
    each, the profile's row with both, and diffusers' LattePipeline at the same work (its frames equal exact's)."""
    out = tmp_path / "speed.json"
    assert main(["bench", "speed", "--prompts", "2", "--spread", "--steps", "4", "--cache", "first_block",
                 "--cfg-trunc", "0.5", "--profile", "fast", "--diffusers", "--json", str(out),
                 "--markdown", str(tmp_path / "b.md")]) == 0
    rows = {r["lever"]: r for r in json.loads(out.read_text())}
    assert list(rows)[:3] == ["exact", "cache kind=first_block, threshold=0.05", "cfg_trunc_ratio=0.5"]
    assert rows["cfg_trunc_ratio=0.5"]["blocks_per_video"] == 6 * (2 * 2 + 2)      # steps 2, 3: cond rows only
    assert any(k.startswith("fast: cache=") for k in rows) and any(k.startswith("fast: cfg_trunc_ratio") for k in rows)
    profile = rows["profile fast"]
    assert profile["options"]["cfg_trunc_ratio"] > 0 and profile["options"]["cache"]["kind"] == "first_block"
    peer = rows["diffusers (its own pipeline, prompts in turn)"]
    assert peer["psnr_db"] > 60 and peer["wall_s"] > 0 and peer["videos"] == 2
    assert "--profile fast --diffusers --spread" in (tmp_path / "b.md").read_text()

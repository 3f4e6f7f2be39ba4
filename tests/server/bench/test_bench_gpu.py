"""`longserve bench gpu` (docs/gpu.md's measurements) at smoke sizes on the CPU: every section runs, and the
figures it reports say what they claim (our 1-worker forward is diffusers' forward)."""

import json

from longserve.server.cli import main


def test_bench_gpu_smoke_reports_each_section(tmp_path):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "gpu", "--smoke", "--device", "cpu", "--repeats", "1", "--sections",
                 "numerics,speed,memory,backends", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "error" in r], rows
    numerics = [r for r in rows if r["section"] == "numerics" and "model" in r]
    assert {r["model"].split(" ")[0] for r in numerics} == {"latte-1", "wan2.1-1.3b"}
    for r in numerics:  # bf16 rounding error, and ours the same arithmetic as diffusers'
        assert 0 < r["diffusers_bf16_rel_err"] < 0.05
        assert r["ours_bf16_rel_err"] <= 1.01 * r["diffusers_bf16_rel_err"]
    speed = [r for r in rows if r["section"] == "speed" and "model" in r]
    assert len(speed) == 3 and all(r["ours_s"] > 0 and r["diffusers_s"] > 0 for r in speed)
    memory = [r for r in rows if r["section"] == "memory" and "component" in r]
    steps = [r for r in memory if r["component"].startswith("transformer") and r["model"] == "latte-1"]
    assert len(steps) == 2 and steps[1]["peak_gib"] > steps[0]["peak_gib"]  # more frames, more memory
    backends = {r["backend"]: r for r in rows if r["section"] == "backends" and "backend" in r}
    assert list(backends)[0] == "default" and list(backends)[-1] == "default (again)"
    # the default's arithmetic: in bf16 the CPU may take another SDPA kernel for the dispatcher's layout (seen on an
    # Intel AVX-512 machine: 3.3e-3), so within bf16 rounding (2**-7), not bit for bit
    assert backends["native"]["rel_err"] < 2 ** -7 and backends["native"]["step_s"] > 0
    assert "attention_backend='flash'" in backends["flash"]["skipped"] and "cpu" in backends["_native_cudnn"]["skipped"]
    # diffusers' set_attention_backend sets the process's active backend too: the section puts it back (the second
    # default row measured the last backend set, and this process's later diffusers runs failed on _native_flash)
    assert _AttentionBackendRegistry._active_backend == active


def test_bench_gpu_wan_vae_smoke_times_diffusers_and_our_streamed_decode_untiled_and_tiled(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "gpu", "--smoke", "--device", "cpu", "--sections", "wan-vae", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "error" in r], rows
    components = [r["component"] for r in rows if "component" in r]
    assert components == ["Wan VAE decode, diffusers one call"] + [
        f"Wan VAE decode, ours streamed (1 latent frame per call, {how})" for how in ("untiled", "tiled")]
    assert all(r["seconds"] > 0 and r["peak_gib"] > 0 for r in rows if "component" in r)


def test_bench_gpu_wan_stages_smoke_splits_both_pipelines_time_for_each_vae_dtype(tmp_path):
    """docs/gpu.md's "where the last 7% was": our video and diffusers' on one checkpoint, each VAE dtype, with
    diffusers' stages timed; the frames agree (bf16 rounding) and the stages add up to no more than the whole."""
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "gpu", "--smoke", "--device", "cpu", "--sections", "wan-stages", "--work-dir",
                 str(tmp_path / "work"), "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "error" in r], rows
    stages = {r["vae_dtype"]: r for r in rows if r["section"] == "wan-stages" and "vae_dtype" in r}
    assert set(stages) == {"bfloat16", "float32"}
    for r in stages.values():
        assert r["diffusers_transformer_calls"] == {"transformer": 2 * r["steps"]}          # CFG: two calls a step
        assert 0 < sum(r["diffusers_stages"].values()) <= r["diffusers_timed_s"]
        assert r["ours_stages"]["vae_s"] > 0 and r["max_abs_diff_vs_diffusers"] < 0.05
    assert (tmp_path / "work" / "wan2.1-1.3b-smoke" / "model_index.json").is_file()     # kept for the next section


def test_bench_gpu_step_14b_smoke_times_diffusers_and_the_fast_step_scaled_to_40_blocks(tmp_path):
    """`--profile fast`'s step section at a tiny shape on the CPU (tools/gpu_session_fast.sh runs it on a GPU): the
    rows it prints, scaled back to the 40 blocks of Wan 2.1 I2V 14B, FP8 refused with its reason off CUDA."""
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "gpu", "--smoke", "--device", "cpu", "--repeats", "1", "--sections", "step-14b",
                 "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "error" in r], rows
    steps = {r["variant"]: r for r in rows if r["section"] == "step-14b" and "variant" in r}
    assert list(steps) == ["diffusers forward", "ours fast (compile blocks, attention default)", "ours fp8 + compile"]
    for r in list(steps.values())[:2]:
        assert r["step_s_at_40_layers"] == r["step_s_measured"] * 40 / r["layers"] > 0
    assert "CUDA" in steps["ours fp8 + compile"]["skipped"]

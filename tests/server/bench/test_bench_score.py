"""`longserve bench score` end to end at a toy size: rows, accounting, ratios, docs section."""

import argparse
import json

from tools.bench import score as bench_score


def test_bench_score_rows_agree_with_the_baseline_and_write_their_own_docs_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Someone else's section\n\nkeep me\n")
    parser = argparse.ArgumentParser()
    bench_score.add_arguments(parser)
    args = parser.parse_args(["--tokens", "96", "--workers", "1,2", "--strategies", "lss,ring-zigzag",
                              "--repeat", "1", "--markdown", str(doc), "--plot", str(tmp_path / "p.png"),
                              "--json", str(tmp_path / "b.json")])
    assert bench_score.run(args) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    layers = bench_score.BENCH_CONFIG["num_hidden_layers"]
    assert [(r["workers"], r["method"]) for r in rows] == [
        (1, "transformers (baseline)"), (1, "lss"), (1, "ring-zigzag"), (2, "lss"), (2, "ring-zigzag")]
    for r in rows:
        assert r["nll_rel_diff"] < 1e-5 and r["peak_mib_per_worker"] > 0
    two = {r["method"]: r for r in rows if r["workers"] == 2}
    assert two["lss"]["calls"] == {"all_gather": layers, "all_reduce": 1}
    assert two["ring-zigzag"]["calls"] == {"send_recv": layers, "all_reduce": 1}
    text = doc.read_text()
    assert "keep me" in text and text.count(bench_score.SECTION) == 1
    assert "longserve bench score --tokens 96" in text and "| 96 | lss | 2 |" in text
    assert (tmp_path / "p.png").stat().st_size > 0
    # a rerun replaces the section instead of appending a second one
    section = bench_score.markdown_section(rows, args, None, doc, [None, None])
    bench_score.replace_markdown_section(doc, bench_score.SECTION, section)
    assert doc.read_text().count(bench_score.SECTION) == 1 and "keep me" in doc.read_text()


def test_bench_score_no_baseline_runs_only_the_strategies_and_says_so(tmp_path):
    # how docs/gpu.md scores 131072 tokens on one GPU: transformers' own forward would need ~94 GiB of logits
    parser = argparse.ArgumentParser()
    bench_score.add_arguments(parser)
    args = parser.parse_args(["--tokens", "64", "--workers", "1", "--strategies", "lss", "--repeat", "1",
                              "--no-baseline", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "p.png")])
    assert bench_score.run(args) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert [(r["tokens"], r["method"]) for r in report["rows"]] == [(64, "lss")]
    row = report["rows"][0]
    assert row["seconds"] > 0 and row["peak_mib_per_worker"] > 0 and row["total_nll"] > 0
    assert row["nll_rel_diff"] is None and row["peak_vs_baseline"] is None and row["speed_vs_baseline"] is None
    assert report["command"].endswith("--no-baseline --repeat 1")
    assert report["config"] == bench_score.BENCH_CONFIG
    section = bench_score.markdown_section(report["rows"], args, None, tmp_path / "b.md", [None, None])
    assert "| 64 | lss | 1 |" in section and "fp32, random weights (`BENCH_CONFIG`" in section

"""`longserve bench score` end to end at a toy size: rows, accounting, ratios, docs section."""

import argparse
import json

from server.bench import score as bench_score


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

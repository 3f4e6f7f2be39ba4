"""`longserve bench vae` end to end at a toy size: rows, exactness, flat memory, its own docs section."""

import argparse
import json

import pytest

from tools.bench import vae as bench_vae


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench_vae.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_vae_rows_match_diffusers_and_write_their_own_docs_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Someone else's section\n\nkeep me\n")
    # 32x24 pixels = a 4x3 latent; 24-pixel tiles every 16: a 2x2 grid
    args = _args("--workers", "1,2", "--frames", "9", "--long-frames", "21", "--size", "32x24", "--tile", "24/16",
                 "--markdown", str(doc), "--json", str(tmp_path / "b.json"))
    assert bench_vae.run(args) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["method"], r["frames"], r["workers"]) for r in rows] == [
        ("diffusers, plain", 9, 1), ("diffusers, tiled", 9, 1), ("streaming, one chunk", 9, 1),
        ("streaming", 9, 1), ("streaming", 9, 2),
        ("diffusers, plain", 21, 1), ("diffusers, tiled", 21, 1), ("streaming", 21, 1)]
    streams = [r for r in rows if r["method"].startswith("streaming")]
    assert all(r["max_abs_err"] == 0.0 and r["grid"] == [2, 2] for r in streams)
    by = {(r["method"], r["frames"], r["workers"]): r for r in rows}
    # flat in the video's length once every cache is full (from 3 latent frames on)
    assert by["streaming", 21, 1]["peak_mib"] == by["streaming", 9, 1]["peak_mib"]
    assert by["streaming", 9, 2]["peak_mib"] < by["streaming", 9, 1]["peak_mib"]
    assert by["streaming", 9, 2]["sent_mib"] > 0 and by["streaming", 9, 1]["sent_mib"] == 0
    text = doc.read_text()
    assert "keep me" in text and text.count(bench_vae.SECTION) == 1
    assert "longserve bench vae --model tiny --workers 1,2 --frames 9" in text and "a 2x2 grid" in text


def test_bench_vae_rows_split_is_exact_and_timed_against_one_worker(tmp_path):
    # 32x32 pixels = a 4x4 latent: bands of 2 rows on 2 pinned workers, one thread each
    args = _args("--workers", "1,2", "--frames", "5", "--long-frames", "0", "--size", "32x32", "--tile", "off",
                 "--split", "rows", "--pin", "--no-memory", "--json", str(tmp_path / "b.json"),
                 "--markdown", str(tmp_path / "b.md"))
    assert bench_vae.run(args) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["method"], r["workers"]) for r in rows] == [("diffusers, plain", 1), ("rows split", 1),
                                                           ("rows split", 2)]
    split = rows[1:]
    assert all(r["max_abs_err"] <= 1e-5 and r["speedup"] > 0 and r["cpu_s"] > 0 for r in split)
    assert split[1]["sent_mib"] > 0 and split[0]["sent_mib"] == 0
    text = (tmp_path / "b.md").read_text()
    assert "--split rows --pin --no-memory" in text and "Rows split (each worker pinned" in text


@pytest.mark.parametrize("argv, field", [
    (("--split", "cols"), "--split"),
    (("--size", "30x24"), "--size"),
    (("--tile", "24"), "--tile"),
    (("--chunk", "0"), "--chunk"),
    (("--workers", "0"), "--workers"),
])
def test_bench_vae_rejects_bad_options_naming_them(argv, field):
    with pytest.raises(ValueError, match=field):
        bench_vae.measure(_args(*argv))

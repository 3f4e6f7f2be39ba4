"""`longserve bench lora`: one step's time with no adapter, one, and two different ones in a batch, side by side."""

import json

import pytest

from longserve.server.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_lora_times_every_case_in_one_run(tmp_path):
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--config", "tiny", "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["no adapter loaded", "loaded, no row uses one", "one adapter, every row",
                                         "peft set_adapters (one)", "two adapters, two rows each",
                                         "one adapter, half the rows"]
    assert all(r["step_s"] > 0 and r["rows"] == 4 for r in rows) and rows[0]["overhead_pct"] == 0

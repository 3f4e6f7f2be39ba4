"""`longserve bench live-latency`: bad arguments are refused before the model loads or a browser starts, and the
per-path summary's figures. (The run itself drives a server and Chromium: docs/benchmarks.md gives the command; the
page's latency figure is tests/server/test_ui_live.py's.)"""

import pytest

from longserve.server.cli import main
from tools.bench.live_latency import summary


@pytest.mark.parametrize("argv, message", [(["--paths", "fmp4,carrier-pigeon"], "--paths"),
                                           (["--chunks", "2"], "--chunks"), (["--rounds", "0"], "--rounds")])
def test_bad_arguments_are_refused_naming_the_option(argv, message, capsys):
    assert main(["bench", "live-latency", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_summary_has_the_median_p90_and_time_to_first_frame():
    row = summary("webrtc", [float(v) for v in range(10, 0, -1)], [300.0, 100.0, 200.0])
    assert (row["chunks_measured"], row["median_ms"], row["p90_ms"], row["ttff_ms"]) == (10, 5.5, 10.0, 200.0)
    assert row["latencies_ms"][0] == 10.0 and row["what"].startswith("WebRTC")
    assert summary("fmp4", [], [])["median_ms"] is None

"""`longserve generate`: what `make demo` runs, end to end in a subprocess."""

import subprocess
import sys

import imageio.v3 as iio


def _longserve(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_writes_an_mp4_with_the_requested_frames_and_size(tmp_path):
    out = tmp_path / "demo.mp4"
    proc = _longserve("generate", "a red ball bouncing", "--model", "tiny-latte", "--workers", "2",
                      "--frames", "11", "--size", "80x48", "--steps", "3", "--seed", "0", "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    frames = iio.imread(out)
    assert frames.shape == (11, 48, 80, 3)  # --size is WIDTHxHEIGHT
    assert "denoising" in proc.stderr and "3/3" in proc.stderr  # the tqdm bar reached the end
    assert f"wrote {out}" in proc.stdout and "generation" in proc.stdout


def test_generate_rejects_a_bad_size_naming_it(tmp_path):
    proc = _longserve("generate", "x", "--size", "64by64", "-o", str(tmp_path / "x.mp4"))
    assert proc.returncode == 2
    assert "size" in proc.stderr


def test_generate_rejects_a_missing_model_naming_it(tmp_path):
    proc = _longserve("generate", "x", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "x.mp4"))
    assert proc.returncode != 0
    assert "nope" in proc.stderr

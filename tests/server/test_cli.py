"""`longserve generate`: what `make demo` runs, end to end (the entry point as a subprocess where a signal
matters, in this process otherwise), and the one completion of a request shared with the other doors."""

import subprocess
import sys
import time

import imageio.v3 as iio
import pytest


def test_one_request_through_python_the_cli_and_http_makes_one_spec(tmp_path, capfd, monkeypatch, http_client):
    """The engine completes every door's request in one place: the same request, with the same operator defaults
    (`default_steps`, `default_fps`), becomes the same spec through the pipeline, `longserve generate` (in this
    process; the entry point as a subprocess in the interrupted-video test below) and `POST /v1/videos`. Only
    what a door must differ in differs: its request id and output type."""
    import dataclasses
    import time

    from servers import serving

    from longserve.engine.engine import VideoEngine
    from longserve.pipelines import VideoPipeline
    from longserve.server.cli import main

    specs, submit = [], VideoEngine.submit

    def recording(engine, request):
        handle = submit(engine, request)
        specs.append(handle.spec)
        return handle

    monkeypatch.setattr(VideoEngine, "submit", recording)
    operator = dict(model="tiny-latte", workers=1, device="cpu", default_steps=2, default_fps=4)
    with VideoPipeline.from_pretrained(**operator) as pipe:
        pipe("a red ball bouncing", seconds=2, height=32, width=48, seed=7)
    out = tmp_path / "demo.mp4"
    assert main(["generate", "a red ball bouncing", "--model", "tiny-latte", "--workers", "1", "--device", "cpu",
                 "--seconds", "2", "--size", "48x32", "--seed", "7", "--default-steps", "2", "--default-fps", "4",
                 "-o", str(out)]) == 0
    with serving(tmp_path / "data", score_model="none", **operator) as s:
        http = http_client(s["url"])
        video = http.post("/v1/videos", json={"prompt": "a red ball bouncing", "seconds": "2", "size": "48x32",
                                              "seed": 7}).json()
        while http.get(f"/v1/videos/{video['id']}").json()["status"] not in ("completed", "failed"):
            time.sleep(0.05)
    python, cli, served = [dataclasses.replace(spec, request_id="", output="") for spec in specs]
    assert python == cli == served
    assert (python.num_frames, python.height, python.width, python.num_inference_steps, python.fps) == (8, 32, 48, 2, 4)
    assert python.guidance_scale == 7.5 and python.seed == 7, "the model's guidance; the seed given"
    assert iio.imread(out).shape == (8, 32, 48, 3)  # --size is WIDTHxHEIGHT
    captured = capfd.readouterr()
    assert "denoising" in captured.err and "2/2" in captured.err  # the tqdm bar reached the end
    assert f"wrote {out}" in captured.out and "at 4 fps" in captured.out


def test_generate_rejects_a_bad_size_and_a_missing_model_naming_them(tmp_path, capsys):
    from longserve.server.cli import main

    assert main(["generate", "x", "--size", "64by64", "-o", str(tmp_path / "x.mp4")]) == 2
    assert "size" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "x.mp4")]) == 2
    assert "nope" in capsys.readouterr().err


def test_generate_a_long_video_writes_every_segment_with_a_bar_over_all_steps(tmp_path, capfd):
    from longserve.server.cli import main

    out = tmp_path / "long.mp4"
    assert main(["generate", "a ship at sea", "--model", "tiny-skyreels-df", "--frames", "37", "--base-frames", "17",
                 "--overlap", "9", "--ar-step", "0", "--causal-block", "1", "--size", "64x64", "--steps", "2",
                 "--seed", "0", "-o", str(out)]) == 0
    assert iio.imread(out).shape == (37, 64, 64, 3)
    err = capfd.readouterr().err
    assert "8/8" in err, "the bar counts the 2 steps of each of the 4 segments"
    bars = [b for b in err.replace("\r", "\n").splitlines() if b.startswith("denoising")]
    assert bars and all("/8 " in b for b in bars), "the total is the whole video's from the first draw (issue 36)"


def test_an_interrupted_long_video_leaves_a_playable_file_of_the_frames_made_so_far(tmp_path):
    import os
    import re
    import signal
    import threading
    import time

    out = tmp_path / "partial.mp4"
    # 10 segments of 5 steps: 17 frames, then 8 more per segment. The interrupt comes once the progress bar
    # has passed the first segment (its frames are in the writer), not when the file first has bytes: the
    # encoder runs at a lower priority and on a loaded machine its first bytes can lag far behind
    proc = subprocess.Popen([sys.executable, "-m", "longserve.server.cli", "generate", "waves",
                             "--model", "tiny-skyreels-df", "--frames", "89", "--size", "64x64", "--steps", "5",
                             "--seed", "0", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell without job control starts background commands with SIGINT ignored, and
                            # the child would inherit that (the suite run as `make test &` saw exit code 0)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while True:
        done = [int(n) for n in re.findall(r"(\d+)/50", "".join(err[-400:]))]
        if done and max(done) >= 7:                       # into the second segment
            break
        assert proc.poll() is None and time.monotonic() < deadline, "".join(err)[-2000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    assert proc.returncode == 130, "".join(err)[-2000:]
    frames = iio.imread(out)
    assert 17 <= frames.shape[0] < 89 and frames.shape[1:] == (64, 64, 3)


def test_engine_options_are_flags_generated_from_the_config_and_reach_the_engine_unchanged(tmp_path, monkeypatch):
    """Every EngineConfig field is a `serve` flag with the field's help text (the model's fields are
    `generate` flags too), and what the flags say is the config VideoEngine.start gets, from both commands."""
    import dataclasses

    from longserve.engine.config import EngineConfig
    from longserve.engine.engine import VideoEngine
    from longserve.server.cli import build_parser, generate, serve

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    for command, groups in (("serve", ("model", "defaults", "scheduling")), ("generate", ("model", "defaults"))):
        helps = {a.dest: a.help for a in subcommands[command]._actions}
        for f in dataclasses.fields(EngineConfig):
            if f.metadata["group"] in groups:
                assert helps.get(f.name, "").startswith(f.metadata["help"]), (command, f.name)

    seen = []

    def start(cls, config=None, **options):
        seen.append(config)
        raise RuntimeError("stop here: only the config matters")

    monkeypatch.setattr(VideoEngine, "start", classmethod(start))
    for argv in (["generate", "x"], ["generate", "x", "--vae-tiling", "--workers", "3", "--dtype", "bf16"]):
        with pytest.raises(RuntimeError, match="stop here"):
            generate.run(parser.parse_args(argv + ["-o", str(tmp_path / "x.mp4")]))
    for argv in (["serve"], ["serve", "--vae-tiling", "--max-queue", "5", "--job-timeout", "none", "--oom-retry"]):
        with pytest.raises(RuntimeError, match="stop here"):
            serve.build(parser.parse_args(argv + ["--data-dir", str(tmp_path / "data"), "--score-model", "none"]))
    plain, flagged, served, served_flagged = seen
    assert plain == EngineConfig(model="tiny-latte", decode_chunk_frames=1 << 30, max_steps_per_job=8)
    assert (flagged.vae_tiling, flagged.workers, flagged.dtype) == (True, 3, "bf16")
    assert served == EngineConfig(max_queue=256)
    assert (served_flagged.vae_tiling, served_flagged.max_queue, served_flagged.job_timeout_s,
            served_flagged.oom_retry) == (True, 5, None, True)


def test_generate_extends_an_mp4_and_writes_the_whole_extended_video(tmp_path, capfd):
    import numpy as np

    from longserve.pipelines.video import save_video
    from longserve.server.cli import main

    given, out = tmp_path / "in.mp4", tmp_path / "longer.mp4"
    y, x = np.mgrid[0:64, 0:64]
    frames = np.full((9, 64, 64, 3), 0.5, np.float32)
    for t in range(9):
        frames[t][(y - 32) ** 2 + (x - 12 - 3 * t) ** 2 < 100] = (0.8, 0.15, 0.15)
    save_video(frames, given, fps=8)
    # 13 frames: the 9 of overlap_history re-make the input's end, 4 are new
    assert main(["generate", "the ball rolls on", "--model", "tiny-skyreels-df", "--video", str(given), "--frames",
                 "13", "--steps", "1", "--guidance-scale", "1", "--seed", "0", "-o", str(out)]) == 0
    written, original = iio.imread(out), iio.imread(given)
    assert written.shape == (9 + 4, 64, 64, 3)
    assert np.abs(written[:9].astype(int) - original).mean() < 3, "the input's frames first, within MP4 error"
    assert "wrote" in capfd.readouterr().out
    assert main(["generate", "x", "--model", "tiny-skyreels-df", "--video", str(tmp_path / "nope.mp4"),
                 "-o", str(out)]) == 2
    assert "--video" in capfd.readouterr().err


def test_generate_refuses_what_it_can_before_loading_the_model_naming_the_flag(tmp_path, capsys):
    """Refused before the fork server starts and the model loads (issue 36: `--size 64x` took 8 s; an image given
    to a text-only checkpoint failed after the load): the size's syntax, input files, an existing output, and,
    from the checkpoint's model_index.json, an image a text-to-video model cannot take."""
    from longserve.server.cli import main

    out = tmp_path / "x.mp4"
    t0 = time.perf_counter()
    assert main(["generate", "x", "--model", "tiny-latte", "--size", "64x", "-o", str(out)]) == 2
    assert time.perf_counter() - t0 < 2
    assert "--size" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "tiny-latte", "--image", str(tmp_path / "cat.png"), "-o", str(out)]) == 2
    assert "--image: no such file" in capsys.readouterr().err
    out.write_bytes(b"keep me")
    assert main(["generate", "x", "--model", "tiny-latte", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--output: {out} exists" in err and "--overwrite" in err and out.read_bytes() == b"keep me"
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "cat.png")
    assert main(["generate", "x", "--model", "tiny-latte", "--image", str(tmp_path / "cat.png"), "--overwrite",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--image:" in err and "text only" in err and "loaded" not in err and out.read_bytes() == b"keep me"


def test_serve_reads_a_config_file_whose_keys_are_the_config_fields_and_flags_win(tmp_path, capsys):
    """`longserve serve --config serve.yaml` (issue 36, as vLLM users pass it): keys are the settings' fields (or
    their flags' spelling), values as in YAML; a flag given on the command line wins; an unknown key is refused
    naming it, before anything starts."""
    from longserve.server.api.config import ServeConfig
    from longserve.server.cli import build_parser, main, with_config_file
    from longserve.server.cli.serve import config_from_args

    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny-wan\nworkers: 2\nmax-batch: 3\nvae_tiling: true\nretention_s: none\n")
    argv = ["serve", "--config", str(path), "--workers", "1"]
    parser = build_parser()
    args = with_config_file(parser, parser.parse_args(argv), argv)
    config = config_from_args(args)
    assert isinstance(config, ServeConfig)
    engine = config.engine
    assert (config.model, engine.workers, engine.max_batch, engine.vae_tiling, config.retention_s) == (
        "tiny-wan", 1, 3, True, None), "the file's settings, --workers from the command line"
    path.write_text("model: tiny-wan\nmax_batchh: 3\n")
    assert main(argv) == 2
    assert "unknown setting 'max_batchh'" in capsys.readouterr().err


def test_live_writes_a_live_video_with_its_prompt_switch_to_a_file(tmp_path, capfd):
    """`longserve live "prompt" --switch-at S "new prompt" -o live.mp4` (issue 36): the whole video, the switch at
    the first chunk starting at or after S; a switch outside the video or an existing file is refused at once."""
    from longserve.server.cli import main

    out = tmp_path / "live.mp4"
    assert main(["live", "a red ball bouncing", "--switch-at", "0.5", "a blue ball bouncing", "--seconds", "1",
                 "--device", "cpu", "-o", str(out)]) == 0
    assert iio.imread(out).shape == (8, 64, 64, 3), "1 s at tiny-live's 8 fps"
    err = capfd.readouterr().err
    assert "switch to 'a blue ball bouncing' at chunk 2 (0.75 s)" in err, "chunks of 3 frames: 0, 3, 6"
    assert main(["live", "x", "--switch-at", "3", "y", "--seconds", "1", "-o", str(tmp_path / "x.mp4")]) == 2
    assert "--switch-at 3: must be inside the video" in capfd.readouterr().err
    assert main(["live", "x", "-o", str(out)]) == 2
    assert "--output" in capfd.readouterr().err

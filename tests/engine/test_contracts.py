"""The typed contracts between the engine and its doors: a chunk's sound and live chunk are fields, not a dict's
string keys; the stored spec reads back as it was written (one `to_params` / `from_params` pair); the live flag is
the spec's own field."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from longserve.engine.config import Capabilities
from longserve.engine.outputs import FramesChunk, LiveChunkInfo, Sound
from longserve.engine.request import GenerationSpec

ROOT = Path(__file__).resolve().parents[2]


def spec(**given) -> GenerationSpec:
    fields = dict(request_id="r1", prompt=["a red ball"], negative_prompt="blur", num_frames=17, height=64, width=96,
                  num_inference_steps=4, guidance_scale=5.0, seed=7, output="uint8",
                  options={"base_num_frames": 9, "cache": "teacache"}, lora=[{"name": "ink", "scale": 0.5}], fps=16)
    return GenerationSpec(**{**fields, **given})


@pytest.mark.parametrize("live", [False, True])
def test_the_stored_spec_reads_back_as_it_was(live):
    s = spec(live=live, options={"prompt_schedule": [[0, "a"], [2, "b"]]} if live else spec().options)
    stored = s.to_params()
    assert GenerationSpec.from_params(s.request_id, s.prompt[0], stored, output=s.output) == s
    assert stored["options"].get("live", False) is live, "kept where records written before the field hold it"
    assert "live" not in s.options, "to_params does not write into the spec it reads"


def test_a_record_of_an_older_server_reads_its_live_option_as_the_field():
    old = {k: v for k, v in spec().to_params().items() if k != "fps"}
    old["options"] = {"live": True, "prompts": ["a", "b"]}
    back = GenerationSpec.from_params("r", "a", old)
    assert back.live is True and back.options == {"prompts": ["a", "b"]} and back.fps is None


def test_a_chunk_carries_its_sound_and_live_chunk_as_typed_fields():
    chunk = FramesChunk("r", np.zeros((1, 2, 4, 4, 3), np.uint8), 0, 2, 2, 0.0,
                        audio=Sound(np.zeros((1, 2, 480), np.float32), 24000), live=LiveChunkInfo(3, 1))
    assert chunk.audio.seconds == 0.02 and not chunk.audio.latent and chunk.live.prompt_index == 1
    assert Sound(np.zeros((1, 8, 4, 16)), 0).latent, "a latent request's audio latents: rate 0"
    assert FramesChunk("r", None, 0, 1, 1, 0.0).audio is None
    assert Capabilities().sound is False and Capabilities(sound=True).sound


# the layers that read a chunk's extras (the doors, the engine's hand-off): none by a string key
DOORS = ("pipelines/video.py", "server/api/video_jobs.py", "server/api/live.py", "engine/results.py",
         "engine/outputs.py", "engine/core.py", "engine/worker.py", "server/cli/generate.py")
STRING_KEYS = re.compile(r"""info(\.get\(|\[)["'](audio|audio_rate|audio_latents|chunk|prompt_index)["']""")


def test_no_layer_reads_a_chunk_s_sound_or_chunk_by_a_string_key():
    found = [f"{p}:{i}" for p in DOORS for i, line in enumerate((ROOT / p).read_text().splitlines(), 1)
             if STRING_KEYS.search(line)]
    assert not found, found
    fields = {n.target.id for n in ast.walk(ast.parse((ROOT / "engine/outputs.py").read_text()))
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"audio", "live"} <= fields and "info" not in fields


def test_the_scheduler_reads_the_live_flag_from_the_spec_not_its_options():
    source = (ROOT / "engine/scheduler.py").read_text()
    assert 'options.get("live")' not in source and "spec.live" in source


def test_every_door_submits_what_the_engine_accepted():
    """A door hands `engine.submit` the `Accepted` of `engine.accept` (or of the server's `requests` door, which
    calls it), never a spec it would complete again: the server's and the pipeline's every call."""
    calls = []
    for path in [*(ROOT / "server").rglob("*.py"), *(ROOT / "pipelines").rglob("*.py")]:
        if "bench" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "submit" \
                    and ast.unparse(node.func.value).endswith("engine"):
                calls.append((path.relative_to(ROOT).as_posix(), ast.unparse(node.args[0])))
    loose = [(p, a) for p, a in calls if not (a == "accepted" or ".accept(" in a or ".stored(" in a)]
    assert not loose, loose
    # the server starts every job one way (`JobRunner.launch`: submit, roll back, follow), at its four sites
    assert {p for p, _ in calls if p.startswith("server/")} == {"server/api/runner.py"}, calls
    launches = [path.name for path in (ROOT / "server" / "api").glob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch"]
    assert sorted(launches) == ["live.py", "replicas.py", "service.py", "service.py"], launches

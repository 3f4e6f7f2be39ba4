"""`python -m weights.train_tiny_latte` (issue 11): a short run writes a loadable LattePipeline directory with
its training record, and two runs with the same seed give byte-identical weights."""

import json

import torch
from safetensors.torch import load_file

from weights.train_tiny_latte import TRANSFORMER_CONFIG, train


def test_short_training_runs_are_seeded_and_write_a_pipeline_with_its_record(tmp_path):
    runs = []
    for name in ("a", "b"):
        record = train(tmp_path / name, vae_steps=2, steps=2, clips_per_prompt=1, plot=None, log=lambda *_: None)
        runs.append({part: load_file(tmp_path / name / part / "diffusion_pytorch_model.safetensors")
                     for part in ("transformer", "vae")})
    for part in ("transformer", "vae"):
        assert runs[0][part].keys() == runs[1][part].keys()
        assert all(torch.equal(runs[0][part][k], runs[1][part][k]) for k in runs[0][part]), part
    saved = json.loads((tmp_path / "a" / "TRAINING.json").read_text())
    assert saved["seed"] == record["seed"] == 0 and saved["steps"] == 2 and saved["training_clips"] == 40
    config = json.loads((tmp_path / "a" / "transformer" / "config.json").read_text())
    assert config["num_attention_heads"] == 3 == TRANSFORMER_CONFIG["num_attention_heads"]  # odd on purpose
    vae = json.loads((tmp_path / "a" / "vae" / "config.json").read_text())
    assert vae["scaling_factor"] == saved["scaling_factor"] != 0.18215  # fitted to the encoded clips

"""`python -m tools.weights.train_tiny_latte` (issue 11): a short run writes a loadable LattePipeline directory with
its training record, and two runs with the same seed give byte-identical weights."""

import json

import torch
from safetensors.torch import load_file

from tools.weights.train_tiny_latte import GENERATION_DEFAULTS, TRANSFORMER_CONFIG, train


def test_short_training_runs_are_seeded_and_write_a_pipeline_with_its_record(tmp_path):
    runs = []
    for name in ("a", "b"):
        record = train(tmp_path / name, vae_steps=2, steps=2, clips_per_prompt=1, threads=1, plot=None,
                       log=lambda *_: None)
        runs.append({part: load_file(tmp_path / name / part / "diffusion_pytorch_model.safetensors")
                     for part in ("transformer", "vae")})
    for part in ("transformer", "vae"):
        assert runs[0][part].keys() == runs[1][part].keys()
        assert all(torch.equal(runs[0][part][k], runs[1][part][k]) for k in runs[0][part]), part
    saved = json.loads((tmp_path / "a" / "TRAINING.json").read_text())
    assert saved["seed"] == record["seed"] == 0 and saved["steps"] == 2 and saved["training_clips"] == 40
    assert saved["threads"] == 1 and saved["cpu_seconds"] > 0 and saved["seconds"]["total"] > 0
    config = json.loads((tmp_path / "a" / "transformer" / "config.json").read_text())
    assert config["num_attention_heads"] == 3 == TRANSFORMER_CONFIG["num_attention_heads"]  # odd on purpose
    vae = json.loads((tmp_path / "a" / "vae" / "config.json").read_text())
    assert vae["scaling_factor"] == saved["scaling_factor"] != 0.18215  # fitted to the encoded clips
    scheduler = json.loads((tmp_path / "a" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["prediction_type"] == saved["prediction"] == "v_prediction"
    assert json.loads((tmp_path / "a" / "generation_defaults.json").read_text()) == GENERATION_DEFAULTS


def test_both_text_forms_are_what_the_pipeline_encodes():
    """The model learns the two forms `LattePipeline.encode_prompt` produces: one prompt (its tokens
    only) and a list of prompts (all 120 positions, padding zeroed, the negative prompt whole). Each
    stored form equals that prompt's row of a real call, so training sees what inference will."""
    from diffusers import LattePipeline

    from tools.weights import build_tiny_latte
    from tools.weights.train_tiny_latte import encode_vocabulary

    tokenizer, _ = build_tiny_latte.build_tokenizer()
    pipe = LattePipeline(tokenizer=tokenizer, text_encoder=build_tiny_latte.build_text_encoder(), vae=None,
                         transformer=None, scheduler=build_tiny_latte.build_scheduler())
    prompts = ["a red ball bouncing", "a yellow square moving left"]
    forms = encode_vocabulary(pipe, prompts)
    kw = dict(do_classifier_free_guidance=True, negative_prompt="", device=torch.device("cpu"), clean_caption=False,
              mask_feature=True)
    with torch.no_grad():
        listed = pipe.encode_prompt(prompts, **kw)                                   # ((2, 120, C), (2, 120, C))
        for i, prompt in enumerate(prompts):
            alone = pipe.encode_prompt(prompt, **kw)                                 # ((1, L, C), (1, L, C))
            for which in (0, 1):
                assert torch.equal(forms[prompt]["single"][which], alone[which][0])
                assert torch.equal(forms[prompt]["batched"][which], listed[which][i])
            assert forms[prompt]["single"][0].shape[0] < forms[prompt]["batched"][0].shape[0] == 120

"""`weights/tiny-live` (the trained causal few-step Wan) and `python -m tools.weights.train_tiny_live`: the checkpoint
is in the causal layout and loads strictly; the training's two-stream form computes what the runtime's
chunk-by-chunk sampler computes; a short training run is seeded; the rollout fine-tune (issue 45) reads the
runtime's KV cache as the runtime does, and a short fine-tune is seeded."""

import json

import torch

from longserve.weights import TINY_MODELS, resolve_model
from longserve.weights.causal_wan import load_causal_transformer, read_causal_config
from tools.weights.writing import file_digests

TINY_LIVE = TINY_MODELS["tiny-live"]


def test_checkpoint_is_small_in_the_causal_layout_and_loads_strictly():
    files = [p for p in TINY_LIVE.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 6 * 2**20
    cfg = read_causal_config(TINY_LIVE)
    assert cfg["weights"] == "model.safetensors" and cfg["key_prefix"] == "model." and cfg["context_noise"] == 0
    assert cfg["local_attn_size"] % cfg["num_frame_per_block"] == 0 and cfg["sink_size"] < cfg["local_attn_size"]
    assert resolve_model("tiny-live", pipeline_classes={"WanPipeline"}) == TINY_LIVE.resolve()
    model = load_causal_transformer(TINY_LIVE)
    assert model.config.in_channels == model.config.out_channels == 4
    vae = json.loads((TINY_LIVE / "vae" / "config.json").read_text())
    assert vae["scale_factor_temporal"] == 1 and vae["scale_factor_spatial"] == 8 and len(vae["latents_std"]) == 4
    defaults = json.loads((TINY_LIVE / "generation_defaults.json").read_text())
    assert defaults["num_inference_steps"] == len(cfg["denoising_step_list"]) and defaults["fps"] == cfg["fps"]
    wan = file_digests(TINY_MODELS["tiny-wan"])
    live = file_digests(TINY_LIVE)
    for rel, digest in wan.items():
        if rel.startswith(("text_encoder/", "tokenizer/")):
            assert live[rel] == digest, rel


def test_two_stream_training_form_is_the_chunk_by_chunk_sampler():
    """Noisy chunk j of a training window sees what the sampler's chunk sees: the clean chunks before it
    (block-causal among themselves) at the same positions, under the same caption; the compressed text
    (real rows + one weighted zero row) attends like the 512 padded rows."""
    from tools.weights import live_teacher_forcing as TF
    from tools.weights import train_tiny_live as T
    from tools.weights.eval_tiny_live import Sampler

    torch.manual_seed(0)
    sampler = Sampler(TINY_LIVE)
    model = sampler.model
    prompt = "a red ball bouncing"
    text, bias = T.compress_text(T.encode_prompts(*T.load_text(), T.PROMPTS))
    index = T.PROMPTS.index(prompt)
    clean, noisy = torch.randn(1, 4, 9, 8, 8), torch.randn(1, 4, 12, 8, 8)
    t = [1000.0, 900.0, 750.0, 500.0]
    layout = TF.install_processors(model)
    try:
        with torch.no_grad():
            out = TF.two_stream_forward(model, layout, clean, noisy, [0, 1, 2, 3], torch.tensor([t]), text, bias,
                                        torch.full((1, 3), index), torch.full((1, 4), index))
    finally:
        TF.restore_processors(model)
        for block in model.blocks:
            block.attn1.set_processor(sampler.proc)
    for j in range(4):
        ref = sampler.forward(clean[:, :, :3 * j], noisy[:, :, 3 * j:3 * j + 3], t[j], sampler.text(prompt))
        torch.testing.assert_close(out[:, :, 3 * j:3 * j + 3], ref, atol=1e-5, rtol=1e-4)


def test_short_training_runs_are_seeded(tmp_path):
    from safetensors.torch import load_file

    from tools.weights.train_tiny_live import train

    for name in ("a", "b"):
        train(tmp_path / name, vae_steps=2, steps=2, clips=2, threads=1, record_path=tmp_path / f"{name}.json",
              log=lambda *_: None)
    for part in ("model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        a, b = load_file(tmp_path / "a" / part), load_file(tmp_path / "b" / part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b")
    record = json.loads((tmp_path / "a.json").read_text())
    assert record["steps"] == 2 and record["files"] == file_digests(tmp_path / "a")
    load_causal_transformer(tmp_path / "a")


def test_the_fine_tune_s_cache_rollout_predicts_what_the_runtime_s_cache_does():
    """`tools.weights.live_cache_rollout`: the trained model's forward over a row's KV cache (what the rollout
    fine-tune's loss sees) is the engine's own forward over it, past the window's eviction, and has gradients."""
    from longserve.engine.models.causal import CausalConfig
    from tools.weights.live_cache_rollout import CacheRollout

    model = load_causal_transformer(TINY_LIVE)
    rollout = CacheRollout(model, CausalConfig.from_dict(read_causal_config(TINY_LIVE)), 8, 8)
    g = torch.Generator().manual_seed(0)
    text = torch.randn(2, 512, 32, generator=g)
    text[:, 7:] = 0
    rollout.new_rows(2, 512)
    for _ in range(5):                                  # 15 frames written: the ring has evicted
        rollout.context(torch.randn(2, 4, 3, 8, 8, generator=g), text)
    rollout.make(text, g)
    x, t = torch.randn(2, 4, 3, 8, 8, generator=g), torch.tensor([750.0, 500.0])
    flow = rollout.flow(x, t, text)
    with torch.no_grad():
        runtime = rollout.cw(x, t, text, rollout.sp, rollout.rows[0], [0, 0], [False, False])
    torch.testing.assert_close(flow, runtime, atol=1e-6, rtol=1e-5)
    flow.pow(2).mean().backward()
    assert all(p.grad is not None for p in model.blocks[0].attn1.to_q.parameters())


def test_short_fine_tune_runs_are_seeded(tmp_path):
    """`python -m tools.weights.finetune_tiny_live`, short, twice: the same transformer; everything else is the
    source checkpoint's, byte for byte."""
    from tools.weights.finetune_tiny_live import RUNTIME_LOCAL_ATTN_SIZE, RUNTIME_SINK_SIZE, finetune

    for name in ("a", "b"):
        finetune(tmp_path / name, TINY_LIVE, steps=1, clips=1, roll_batch=1, cache_batch=1,
                 record_path=tmp_path / f"{name}.json", log=lambda *_: None)
    a, b = file_digests(tmp_path / "a"), file_digests(tmp_path / "b")
    assert a == b
    source = file_digests(TINY_LIVE)
    changed = {"model.safetensors", "causal_config.json"}
    assert {k: v for k, v in a.items() if k not in changed} == {k: v for k, v in source.items() if k not in changed}
    cfg = read_causal_config(tmp_path / "a")
    assert (cfg["local_attn_size"], cfg["sink_size"]) == (RUNTIME_LOCAL_ATTN_SIZE, RUNTIME_SINK_SIZE)
    record = json.loads((tmp_path / "a.json").read_text())
    assert record["steps"] == 1 and record["files"] == a and record["source_files"] == source
    load_causal_transformer(tmp_path / "a")

"""weights/ for the Wan family: generic resolve_model(), the shipped tiny-wan / tiny-skyreels-df
checkpoints and their builder, the published configs in weights.wan, and real-config checkpoints."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from longserve.weights import (
    TINY_MODELS,
    generation_defaults,
    pipeline_class,
    read_model_index,
    resolve_latte,
    resolve_model,
)
from tests.support.checkpoints import assert_rebuilt, digests, without_stamps
from tools.weights import build_tiny_wan
from tools.weights import wan as published
from tools.weights.train_tiny_skyreels_df import GENERATION_DEFAULTS as GENERATION_DEFAULTS_DF

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_WAN = TINY_MODELS["tiny-wan"]
TINY_DF = TINY_MODELS["tiny-skyreels-df"]
SHIPPED = {"wan": TINY_WAN, "skyreels-df": TINY_DF}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def wan_copy(tmp_path):
    """A private, mutable copy of tiny-wan."""
    dst = tmp_path / "tiny-wan"
    shutil.copytree(TINY_WAN, dst)
    return dst




def _edit_index(root: Path, **changes) -> None:
    path = root / "model_index.json"
    index = json.loads(path.read_text())
    index.update(changes)
    path.write_text(json.dumps(index))


def _load(cls, path):
    pipe = cls.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _config(model) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.config.items() if not k.startswith("_")}


# --- the tiny builder -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", build_tiny_wan.KINDS)
def test_tiny_build_is_byte_reproducible_and_equals_the_committed_checkpoint(tmp_path, kind):
    """Two builds on this machine are byte for byte the same, whatever its CPU; the build equals the committed
    checkpoint byte for byte on the CPU kernels it was built with, and within float rounding on others
    (tests/support/checkpoints.py says why)."""
    first = build_tiny_wan.build(kind, tmp_path / "first")
    assert build_tiny_wan.main(["--kind", kind, "--out", str(tmp_path / "second")]) == 0
    a, b = digests(first), digests(tmp_path / "second")
    assert a == b and len(a) == 12

    if kind == "skyreels-df":   # trained (train_tiny_skyreels_df.py): its text encoder, tokenizer are the builder's
        files = [rel for rel in a if rel.startswith(("text_encoder/", "tokenizer/"))]
        assert len(files) == 5
        assert_rebuilt(first, SHIPPED[kind], files)
    else:
        assert_rebuilt(first, SHIPPED[kind])


def test_tiny_checkpoints_are_small_and_name_the_published_classes():
    for root, index in ((TINY_WAN, published.WAN_2_1_T2V_MODEL_INDEX), (TINY_DF, published.SKYREELS_V2_DF_MODEL_INDEX)):
        files = [p for p in root.rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in files) < (6 if root == TINY_DF else 2) * 2**20   # DF: trained, wider
        assert not any(p.suffix == ".bin" for p in files)
        assert without_stamps(root / "model_index.json") == index
    # Wan 2.1's published model_index.json has no transformer_2 / boundary_ratio key at all.
    assert "transformer_2" not in read_model_index("tiny-wan") and "boundary_ratio" not in read_model_index("tiny-wan")


# --- resolve_model ----------------------------------------------------------------------------
def test_resolve_model_finds_every_shipped_name_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    classes = {"tiny-latte": "LattePipeline", "tiny-wan": "WanPipeline",
               "tiny-skyreels-df": "SkyReelsV2DiffusionForcingPipeline", "tiny-live": "WanPipeline",
               "tiny-wan-i2v": "WanImageToVideoPipeline", "tiny-i2v": "WanImageToVideoPipeline",
               "tiny-wan-flf2v": "WanImageToVideoPipeline",
               "tiny-wan22-ti2v": "WanPipeline", "tiny-wan22-i2v-a14b": "WanImageToVideoPipeline",
               "tiny-skyreels-i2v": "SkyReelsV2ImageToVideoPipeline",
               "tiny-skyreels-df-i2v": "SkyReelsV2DiffusionForcingImageToVideoPipeline",
               "tiny-skyreels-df-v2v": "SkyReelsV2DiffusionForcingVideoToVideoPipeline",
               "tiny-helios": "HeliosPipeline", "tiny-helios-distilled": "HeliosPyramidPipeline",
               "tiny-hunyuan15": "HunyuanVideo15Pipeline", "tiny-hunyuan15-i2v": "HunyuanVideo15ImageToVideoPipeline",
               "tiny-ltx2": "LTX2Pipeline", "tiny-ltx2-i2v": "LTX2ImageToVideoPipeline",
               "tiny-ltx2-upsample": "LTX2Pipeline", "tiny-sana-video": "SanaVideoPipeline",
               "tiny-sana-video-i2v": "SanaImageToVideoPipeline", "tiny-framepack": "HunyuanVideoFramepackPipeline"}
    assert sorted(TINY_MODELS) == sorted(classes)
    for name, cls in classes.items():
        root = resolve_model(name)
        assert root == TINY_MODELS[name].resolve() == (REPO_ROOT / "weights" / name).resolve()
        assert pipeline_class(name) == pipeline_class(root) == read_model_index(root)["_class_name"] == cls
    assert resolve_model(str(TINY_WAN)) == resolve_model(TINY_WAN) == TINY_WAN.resolve()


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder", "tokenizer", "scheduler"])
def test_missing_component_folder_is_named(wan_copy, component):
    shutil.rmtree(wan_copy / component)
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model(wan_copy)
    assert f"{component}/ is missing" in str(ei.value) and str(wan_copy / component) in str(ei.value)


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder"])
def test_missing_weight_file_is_named(wan_copy, component):
    for p in (wan_copy / component).glob("*.safetensors"):
        p.unlink()
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model(wan_copy)
    assert f"{component} weights are missing" in str(ei.value) and str(wan_copy / component) in str(ei.value)


@pytest.mark.parametrize("component,config", [("transformer", "config.json"), ("vae", "config.json"),
                                              ("text_encoder", "config.json"), ("scheduler", "scheduler_config.json")])
def test_missing_config_is_named(wan_copy, component, config):
    (wan_copy / component / config).unlink()
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model(wan_copy)
    assert f"{component} config is missing" in str(ei.value) and str(wan_copy / component / config) in str(ei.value)


def test_tokenizer_needs_a_vocabulary(wan_copy):
    for name in ("tokenizer.json", "spiece.model"):
        (wan_copy / "tokenizer" / name).unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer vocabulary is missing"):
        resolve_model(wan_copy)
    (wan_copy / "tokenizer" / "spiece.model").write_bytes((TINY_WAN / "tokenizer" / "spiece.model").read_bytes())
    assert resolve_model(wan_copy) == wan_copy.resolve()


def test_sharded_weights_need_every_shard(wan_copy):
    sub = wan_copy / "transformer"
    (sub / "diffusion_pytorch_model.safetensors").rename(sub / "diffusion_pytorch_model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(sub / "diffusion_pytorch_model-00001-of-00002.safetensors", "pt") as f:
        keys = sorted(f.keys())
    weight_map = {k: f"diffusion_pytorch_model-0000{1 + (i % 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (sub / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model(wan_copy)
    assert "diffusion_pytorch_model-00002-of-00002.safetensors" in str(ei.value) and "transformer" in str(ei.value)
    (sub / "diffusion_pytorch_model-00002-of-00002.safetensors").write_bytes(b"")
    assert resolve_model(wan_copy) == wan_copy.resolve()


def test_null_entries_and_settings_are_not_components_but_listed_ones_are(wan_copy):
    _edit_index(wan_copy, transformer_2=[None, None], boundary_ratio=None, expand_timesteps=False)
    assert resolve_model(wan_copy) == wan_copy.resolve()  # how diffusers >= 0.35 spells "no second expert"
    _edit_index(wan_copy, transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    with pytest.raises(FileNotFoundError, match=r"transformer_2/ is missing"):
        resolve_model(wan_copy)
    shutil.copytree(wan_copy / "transformer", wan_copy / "transformer_2")
    assert resolve_model(wan_copy) == wan_copy.resolve()
    _edit_index(wan_copy, transformer_2=["diffusers", None])
    with pytest.raises(ValueError, match="'transformer_2'"):
        resolve_model(wan_copy)


def test_config_class_must_match_model_index(wan_copy):
    cfg_path = wan_copy / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_class_name"] = "SkyReelsV2Transformer3DModel"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as ei:
        resolve_model(wan_copy)
    assert "'SkyReelsV2Transformer3DModel'" in str(ei.value) and "'WanTransformer3DModel'" in str(ei.value)
    assert str(cfg_path) in str(ei.value)


@pytest.mark.parametrize("hub_id", ["Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers"])
def test_hub_id_is_not_downloaded_and_the_message_says_how_to_fetch_it(hub_id, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as ei:
        resolve_model(hub_id)
    msg = str(ei.value)
    assert "nothing is downloaded" in msg and f"huggingface-cli download {hub_id} --local-dir" in msg
    assert "tiny-wan" in msg  # lists the names that do work


def test_pipeline_class_can_be_required(tmp_path):
    with pytest.raises(ValueError) as ei:
        resolve_model("tiny-skyreels-df", pipeline_classes={"WanPipeline"})
    assert "'SkyReelsV2DiffusionForcingPipeline'" in str(ei.value) and "WanPipeline" in str(ei.value)
    with pytest.raises(ValueError, match="'WanPipeline'"):
        resolve_latte("tiny-wan")


def test_generation_defaults_are_read_from_the_checkpoint_root(wan_copy):
    assert generation_defaults("tiny-wan") == build_tiny_wan.WAN_GENERATION_DEFAULTS
    assert generation_defaults(TINY_DF) == GENERATION_DEFAULTS_DF
    (wan_copy / "generation_defaults.json").unlink()
    assert generation_defaults(wan_copy) == {}  # a real checkpoint: the pipeline's defaults apply
    (wan_copy / "generation_defaults.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        generation_defaults(wan_copy)


# --- the shipped checkpoints in diffusers -------------------------------------------------------
def test_tiny_wan_runs_end_to_end_in_diffusers(offline):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    pipe = _load(WanPipeline, resolve_model("tiny-wan"))
    assert isinstance(pipe.transformer, WanTransformer3DModel) and pipe.transformer_2 is None
    assert isinstance(pipe.vae, AutoencoderKLWan) and isinstance(pipe.text_encoder, UMT5EncoderModel)
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler)
    assert pipe.config.boundary_ratio is None and pipe.config.expand_timesteps is False
    tc = pipe.transformer.config
    assert (tc.num_attention_heads, tc.attention_head_dim, tc.num_layers, tuple(tc.patch_size)) == (3, 12, 2, (1, 2, 2))
    rope = pipe.transformer.rope
    assert (rope.t_dim, rope.h_dim, rope.w_dim) == (4, 4, 4)
    assert tc.text_dim == pipe.text_encoder.config.d_model
    assert tc.in_channels == tc.out_channels == pipe.vae.config.z_dim == len(pipe.vae.config.latents_mean)
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    assert 2 ** len(pipe.vae.temperal_downsample) == 8  # how SkyReels-V2 pipelines derive it
    sc = pipe.scheduler.config
    assert (sc.prediction_type, sc.use_flow_sigmas, sc.flow_shift) == ("flow_prediction", True, 3.0)
    assert len(pipe.tokenizer) == pipe.text_encoder.config.vocab_size and pipe.tokenizer.model_max_length >= 512

    d = generation_defaults("tiny-wan")
    kwargs = dict(height=d["height"], width=d["width"], num_frames=d["num_frames"], num_inference_steps=2,
                  guidance_scale=d["guidance_scale"], output_type="np")
    a = pipe("a red ball", generator=torch.Generator("cpu").manual_seed(0), **kwargs).frames
    b = pipe("a red ball", generator=torch.Generator("cpu").manual_seed(0), **kwargs).frames
    c = pipe("a blue cat", generator=torch.Generator("cpu").manual_seed(0), **kwargs).frames
    assert a.shape == (1, 9, 64, 64, 3) and np.isfinite(a).all()
    assert (a == b).all() and a.std() > 0.01
    assert np.abs(a - c).mean() > 1e-3  # the prompt matters


def test_tiny_wan_transformer_output_depends_on_every_block(offline):
    from diffusers import WanTransformer3DModel

    tr = WanTransformer3DModel.from_pretrained(TINY_WAN, subfolder="transformer").eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 8, 3, 8, 8, generator=g)  # (B, z, latent frames, H/8, W/8)
    emb, emb2 = torch.randn(2, 1, 7, 32, generator=g)  # (B, tokens, text_dim)

    def f(model=tr, t=500, e=emb):
        with torch.no_grad():
            return model(x, timestep=torch.tensor([t]), encoder_hidden_states=e, return_dict=False)[0]

    base = f()
    assert base.shape == x.shape and 0.3 < base.std() < 5
    assert (f(t=100) - base).abs().mean() > 0.05 and (f(e=emb2) - base).abs().mean() > 0.01
    for name in ("blocks.0", "blocks.1", "condition_embedder.text_embedder", "proj_out"):
        m = copy.deepcopy(tr)
        with torch.no_grad():
            for p in m.get_submodule(name).parameters():
                p.zero_()
        assert (f(model=m) - base).abs().mean() > 0.01, name


def test_tiny_skyreels_df_makes_a_long_video_in_segments(offline):
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel

    pipe = _load(SkyReelsV2DiffusionForcingPipeline, resolve_model("tiny-skyreels-df"))
    assert isinstance(pipe.transformer, SkyReelsV2Transformer3DModel)
    tc = pipe.transformer.config
    assert tc.inject_sample_info is True and hasattr(pipe.transformer, "fps_embedding")
    assert (tc.num_attention_heads, tc.attention_head_dim, tc.num_frame_per_block) == (3, 32, 1)
    assert pipe.vae_scale_factor_temporal == 1      # tiny-live's VAE: one latent frame a frame

    segments = []
    prepare_latents = pipe.prepare_latents

    def counting_prepare_latents(*args, **kwargs):
        out = prepare_latents(*args, **kwargs)
        segments.append(out[1])  # latent frames in this segment
        return out

    pipe.prepare_latents = counting_prepare_latents
    # diffusers rounds num_frames to 4k+1 with k the VAE's temporal factor, and with a factor of 1 that adds a
    # frame to every count (num_frames % 1 is never 1): asking for 36 gives the defaults' 37
    d = dict(generation_defaults("tiny-skyreels-df"), num_inference_steps=2)
    video = pipe("a red ball", generator=torch.Generator("cpu").manual_seed(0), output_type="np",
                 **dict(d, num_frames=d["num_frames"] - 1)).frames
    # 37 frames = 37 latent frames; windows of 17 (base_num_frames) overlapping by 9 (overlap_history)
    assert segments == [17, 17, 17, 13] and len(segments) >= 3
    assert video.shape == (1, 37, 64, 64, 3) and np.isfinite(video).all() and video.std() > 0.01


# --- published configs as data -----------------------------------------------------------------
def _meta_parameter_count(cls, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in cls(**published.init_kwargs(config)).parameters())


def test_published_transformer_configs_have_the_published_sizes():
    from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

    n_13b = _meta_parameter_count(WanTransformer3DModel, published.WAN_2_1_T2V_1_3B_TRANSFORMER)
    # the Hub lists 5.68 GB of fp32 safetensors for Wan2.1-T2V-1.3B-Diffusers/transformer
    assert abs(n_13b * 4 / 5.68e9 - 1) < 0.01
    n_14b = _meta_parameter_count(WanTransformer3DModel, published.WAN_2_1_T2V_14B_TRANSFORMER)
    assert 13.5e9 < n_14b < 15e9
    assert _meta_parameter_count(WanTransformer3DModel, published.WAN_2_2_T2V_A14B_TRANSFORMER) == n_14b  # per expert
    assert _meta_parameter_count(SkyReelsV2Transformer3DModel, published.SKYREELS_V2_T2V_14B_540P_TRANSFORMER) == n_14b
    n_df = _meta_parameter_count(SkyReelsV2Transformer3DModel, published.SKYREELS_V2_DF_1_3B_540P_TRANSFORMER)
    assert n_df > n_13b  # + the fps embedding and projection
    for cfg in (published.WAN_2_1_T2V_1_3B_TRANSFORMER, published.WAN_2_2_T2V_A14B_TRANSFORMER,
                published.SKYREELS_V2_DF_1_3B_540P_TRANSFORMER):
        assert cfg["text_dim"] == published.UMT5_XXL_ENCODER["d_model"] == 4096
        assert cfg["in_channels"] == cfg["out_channels"] == published.WAN_2_1_VAE["z_dim"] == 16
    assert len(published.WAN_2_1_VAE["latents_mean"]) == len(published.WAN_2_1_VAE["latents_std"]) == 16
    assert published.WAN_2_2_T2V_A14B_MODEL_INDEX["boundary_ratio"] == 0.875
    assert set(published.PUBLISHED) == {
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers", "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers",
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers"}
    # Wan 2.2 TI2V-5B: about 5 B parameters, 3072 wide, its VAE's 48 channels in and out
    n_5b = _meta_parameter_count(WanTransformer3DModel, published.WAN_2_2_TI2V_5B_TRANSFORMER)
    assert 4.8e9 < n_5b < 5.2e9
    assert published.WAN_2_2_TI2V_5B_TRANSFORMER["in_channels"] == published.WAN_2_2_VAE["z_dim"] == 48
    assert len(published.WAN_2_2_VAE["latents_mean"]) == len(published.WAN_2_2_VAE["latents_std"]) == 48


# --- real-config checkpoints (tests/support/wan_models.py) ------------------------------------------------
def test_wan21_real_config_checkpoint_loads_and_runs(tmp_path, offline):
    from diffusers import WanPipeline
    from wan_models import build_wan21_checkpoint

    ckpt = resolve_model(build_wan21_checkpoint(tmp_path / "wan21"), pipeline_classes={"WanPipeline"})
    pipe = _load(WanPipeline, ckpt)
    expected = {**published.init_kwargs(published.WAN_2_1_T2V_1_3B_TRANSFORMER), "num_layers": 1}
    assert {k: v for k, v in _config(pipe.transformer).items() if k in expected} == expected
    tc = pipe.transformer.config
    assert (tc.num_attention_heads * tc.attention_head_dim, tc.text_dim) == (1536, 4096)
    assert pipe.text_encoder.config.d_model == 4096 and pipe.vae.config.z_dim == 16
    assert pipe.vae.config.latents_mean == published.WAN_2_1_VAE["latents_mean"]
    assert pipe.scheduler.config.flow_shift == published.WAN_2_1_T2V_SCHEDULER["flow_shift"]

    latents = pipe("a red ball", height=64, width=64, num_frames=5, num_inference_steps=1, guidance_scale=1.0,
                   generator=torch.Generator("cpu").manual_seed(0), output_type="latent").frames
    assert latents.shape == (1, 16, 2, 8, 8) and torch.isfinite(latents).all()


def test_wan22_checkpoint_has_two_experts_and_switches_at_the_boundary(tmp_path, offline):
    from diffusers import WanPipeline
    from wan_models import build_wan22_checkpoint, narrow

    config = narrow(published.WAN_2_2_T2V_A14B_TRANSFORMER, heads=2)  # 256 wide instead of 5120
    ckpt = resolve_model(build_wan22_checkpoint(tmp_path / "wan22", config=config))
    index = read_model_index(ckpt)
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    pipe = _load(WanPipeline, ckpt)
    assert pipe.config.boundary_ratio == published.WAN_2_2_T2V_A14B_BOUNDARY_RATIO
    for expert in (pipe.transformer, pipe.transformer_2):
        cfg = _config(expert)
        assert cfg == {**cfg, **published.init_kwargs(config), "num_layers": 1}
        assert (cfg["attention_head_dim"], cfg["text_dim"], cfg["in_channels"]) == (128, 4096, 16)
    assert not torch.equal(pipe.transformer.proj_out.weight, pipe.transformer_2.proj_out.weight)

    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    pipe("a red ball", height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
         generator=torch.Generator("cpu").manual_seed(0), output_type="latent")
    t = pipe.scheduler.timesteps
    assert t[0] >= 875 > t[1]  # one high-noise step, one low-noise step
    assert calls == {"transformer": 1, "transformer_2": 1}


@pytest.mark.parametrize("kind", ["df", "t2v"])
def test_skyreels_v2_checkpoint_loads_and_runs(tmp_path, offline, kind):
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Pipeline
    from wan_models import build_skyreels_v2_checkpoint, narrow

    if kind == "df":  # the real DF 1.3B config
        cls, config = SkyReelsV2DiffusionForcingPipeline, published.SKYREELS_V2_DF_1_3B_540P_TRANSFORMER
        extra = {"base_num_frames": 5}
        ckpt = build_skyreels_v2_checkpoint(tmp_path / kind, kind=kind)
    else:  # T2V 14B, narrowed to 2 heads
        cls, config, extra = SkyReelsV2Pipeline, narrow(published.SKYREELS_V2_T2V_14B_540P_TRANSFORMER, heads=2), {}
        ckpt = build_skyreels_v2_checkpoint(tmp_path / kind, kind=kind, config=config)
    assert pipeline_class(resolve_model(ckpt)) == cls.__name__
    pipe = _load(cls, ckpt)
    assert _config(pipe.transformer) == {**published.init_kwargs(config), "num_layers": 1}
    assert pipe.transformer.config.inject_sample_info is (kind == "df")
    assert pipe.text_encoder.config.d_model == pipe.transformer.config.text_dim == 4096

    latents = pipe("a red ball", height=64, width=64, num_frames=5, num_inference_steps=1, guidance_scale=1.0,
                   generator=torch.Generator("cpu").manual_seed(0), output_type="latent", **extra).frames
    assert latents.shape == (1, 16, 2, 8, 8) and torch.isfinite(latents).all()

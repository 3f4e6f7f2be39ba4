"""weights/: the shipped tiny Latte checkpoint, its build script and resolve_latte()."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from longserve.weights import TINY_LATTE_DIR, resolve_latte
from longserve.weights.latte import LATTE_1_TRANSFORMER_CONFIG, TINY_MODELS
from tests.support.checkpoints import assert_same_file

REPO_ROOT = Path(__file__).resolve().parents[2]

# Latte-1's transformer config (maxin-cn/Latte-1, transformer/config.json, diffusers layout),
# written out here independently of weights.latte so a typo there is caught.
LATTE_1 = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 72,
    "caption_channels": 4096,
    "cross_attention_dim": 1152,
    "dropout": 0.0,
    "in_channels": 4,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "norm_type": "ada_norm_single",
    "num_attention_heads": 16,
    "num_embeds_ada_norm": 1000,
    "num_layers": 28,
    "out_channels": 8,
    "patch_size": 2,
    "sample_size": 64,
    "video_length": 16,
}


@pytest.fixture
def tiny_copy(tmp_path):
    """A private, mutable copy of the shipped checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(TINY_LATTE_DIR, dst)
    return dst


def _load(path):
    from diffusers import LattePipeline

    pipe = LattePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- resolving ------------------------------------------------------------------------------
def test_resolve_by_name_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = resolve_latte("tiny-latte")
    assert got == TINY_LATTE_DIR == TINY_MODELS["tiny-latte"]
    assert got.is_absolute() and (got / "model_index.json").is_file()
    assert TINY_LATTE_DIR == (REPO_ROOT / "weights" / "tiny-latte").resolve()


def test_resolve_by_path(monkeypatch):
    assert resolve_latte(str(TINY_LATTE_DIR)) == TINY_LATTE_DIR
    assert resolve_latte(TINY_LATTE_DIR) == TINY_LATTE_DIR
    monkeypatch.chdir(REPO_ROOT)
    assert resolve_latte("weights/tiny-latte") == TINY_LATTE_DIR  # relative -> absolute
    assert resolve_latte(Path("weights") / "tiny-latte") == TINY_LATTE_DIR


def test_checkpoint_is_small_and_safetensors():
    files = [p for p in TINY_LATTE_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 20 * 2**20
    names = {p.relative_to(TINY_LATTE_DIR).as_posix() for p in files}
    for comp in ("transformer", "vae"):
        assert f"{comp}/diffusion_pytorch_model.safetensors" in names
    assert "text_encoder/model.safetensors" in names
    assert not any(n.endswith(".bin") for n in names)
    index = json.loads((TINY_LATTE_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "LattePipeline"
    assert index["transformer"] == ["diffusers", "LatteTransformer3DModel"]
    assert index["scheduler"] == ["diffusers", "DDIMScheduler"]


# --- loading and running --------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_build(tmp_path_factory):
    """The untrained builder's checkpoint (tools.weights.build_tiny_latte), for the tests of random weights."""
    from tools.weights.build_tiny_latte import build

    return build(tmp_path_factory.mktemp("random") / "tiny-latte-random")


def test_tiny_pipeline_loads_offline_and_runs(offline):
    from diffusers import AutoencoderKL, DDIMScheduler, LatteTransformer3DModel
    from transformers import T5EncoderModel

    record = json.loads((TINY_LATTE_DIR / "TRAINING.json").read_text())
    pipe = _load(resolve_latte("tiny-latte"))
    assert isinstance(pipe.transformer, LatteTransformer3DModel)
    assert isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.text_encoder, T5EncoderModel)
    assert isinstance(pipe.scheduler, DDIMScheduler)

    tc = pipe.transformer.config
    assert tc.num_attention_heads == 3  # odd on purpose: divides by neither 2 nor 4 workers
    assert (tc.attention_head_dim, tc.num_layers) == (32, 3)
    assert (tc.in_channels, tc.out_channels, tc.patch_size, tc.sample_size, tc.video_length) == (4, 8, 2, 8, 16)
    assert tc.norm_type == "ada_norm_single" and tc.activation_fn == "gelu-approximate"
    assert tc.cross_attention_dim == 96
    assert tc.caption_channels == pipe.text_encoder.config.d_model
    assert pipe.vae_scale_factor == 8 and pipe.vae.config.latent_channels == 4
    assert pipe.vae.config.scaling_factor == pytest.approx(record["scaling_factor"])
    sc = pipe.scheduler.config
    assert (sc.beta_schedule, sc.beta_start, sc.beta_end, sc.num_train_timesteps) == ("linear", 0.0001, 0.02, 1000)
    # trained to predict v (tools/weights/train_tiny_latte.py: it learns the layout at high noise far faster)
    assert sc.prediction_type == record["prediction"] == "v_prediction" and sc.clip_sample is False

    tok = pipe.tokenizer
    assert len(tok) == pipe.text_encoder.config.vocab_size
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "</s>", "<unk>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("a red ball bouncing").input_ids
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids

    # NB: LattePipeline takes `video_length`, not `num_frames`; clean_caption needs bs4/ftfy.
    kwargs = dict(
        video_length=16, height=64, width=64, num_inference_steps=2, guidance_scale=4.5,
        output_type="np", clean_caption=False,
    )
    a = pipe(prompt="a red ball", generator=torch.Generator("cpu").manual_seed(0), **kwargs).frames
    b = pipe(prompt="a red ball", generator=torch.Generator("cpu").manual_seed(0), **kwargs).frames
    c = pipe(prompt="a blue cat", generator=torch.Generator("cpu").manual_seed(0), **kwargs).frames
    assert a.shape == (1, 16, 64, 64, 3)
    assert (a == b).all()
    assert abs(a - c).mean() > 1e-3  # the prompt matters


def test_random_transformer_output_is_nontrivial(offline, random_build):
    """The untrained builder's weights are O(1) everywhere: the output depends on the timestep, the
    prompt and every block (what the tests that want random weights rely on)."""
    pipe = _load(random_build)
    tr = pipe.transformer
    assert (tr.config.num_attention_heads, tr.config.attention_head_dim, tr.config.num_layers) == (3, 8, 2)
    assert pipe.vae.config.scaling_factor == pytest.approx(0.18215)
    emb, _ = pipe.encode_prompt("a red ball", do_classifier_free_guidance=False, clean_caption=False)
    emb2, _ = pipe.encode_prompt("a cat on the moon", do_classifier_free_guidance=False, clean_caption=False)
    x = torch.randn(1, 4, 16, 8, 8, generator=torch.Generator().manual_seed(1))

    def f(model=tr, t=500, e=emb):
        with torch.no_grad():
            return model(x, timestep=torch.tensor([t]), encoder_hidden_states=e, return_dict=False)[0]

    base = f()
    assert base.shape == (1, 8, 16, 8, 8)
    assert base.std() > 0.3
    assert (f(t=100) - base).abs().mean() > 0.05
    assert (f(e=emb2) - base).abs().mean() > 0.05
    import copy

    for name in ("transformer_blocks.0", "transformer_blocks.1",
                 "temporal_transformer_blocks.0", "temporal_transformer_blocks.1"):
        m = copy.deepcopy(tr)
        with torch.no_grad():
            for p in m.get_submodule(name).parameters():
                p.zero_()
        assert (f(model=m) - base).abs().mean() > 0.01, name


# --- reproducibility ------------------------------------------------------------------------
def test_random_build_is_deterministic(tmp_path, random_build):
    """Two builds are byte-identical (every weight redrawn from a fixed seed)."""
    from tools.weights.build_tiny_latte import build
    from tools.weights.writing import file_digests

    again = file_digests(build(tmp_path / "again"))
    first = file_digests(random_build)
    weights = sorted(rel for rel in first if rel.endswith(".safetensors"))
    assert len(weights) == 3
    assert {rel: first[rel] for rel in weights} == {rel: again[rel] for rel in weights}
    assert resolve_latte(random_build) == random_build.resolve()


def test_trained_checkpoint_keeps_the_builders_frozen_text_side(random_build):
    """tools.weights.train_tiny_latte trains the VAE and the transformer only: the committed text encoder,
    tokenizer and scheduler are the random builder's, byte for byte / key for key (the scheduler's
    prediction_type aside: the transformer predicts v). The text encoder's weights are byte for byte the
    builder's on the CPU kernels it was built with, within float rounding on others (tests/support/checkpoints.py)."""
    for rel in ("text_encoder/model.safetensors", "tokenizer/spiece.model", "tokenizer/tokenizer.json"):
        assert_same_file(random_build / rel, TINY_LATTE_DIR / rel)

    def cfg(root, rel):
        d = json.loads((root / rel).read_text())
        return {k: v for k, v in d.items() if not k.startswith("_") and k != "transformers_version"}

    for rel in ("model_index.json", "text_encoder/config.json"):
        assert cfg(TINY_LATTE_DIR, rel) == cfg(random_build, rel), rel
    rel = "scheduler/scheduler_config.json"
    assert cfg(TINY_LATTE_DIR, rel) == {**cfg(random_build, rel), "prediction_type": "v_prediction"}
    for rel in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert _sha256(TINY_LATTE_DIR / rel) != _sha256(random_build / rel), rel  # these are trained


def test_trained_checkpoint_matches_its_training_record():
    """TRAINING.json describes the committed weights: the script's configs, the fitted VAE scale,
    the parameter counts, the measured time and loss, and the versions it ran with."""
    from safetensors.torch import load_file

    from tools.weights.train_tiny_latte import TRANSFORMER_CONFIG, VAE_CONFIG

    record = json.loads((TINY_LATTE_DIR / "TRAINING.json").read_text())
    config = json.loads((TINY_LATTE_DIR / "transformer" / "config.json").read_text())
    assert {k: config[k] for k in TRANSFORMER_CONFIG} == TRANSFORMER_CONFIG
    vae = json.loads((TINY_LATTE_DIR / "vae" / "config.json").read_text())
    as_json = json.loads(json.dumps({k: v for k, v in VAE_CONFIG.items() if k != "scaling_factor"}))  # tuples -> lists
    assert {k: vae[k] for k in as_json} == as_json
    assert vae["scaling_factor"] == record["scaling_factor"] != 0.18215  # fitted to the encoded clips
    for part in ("transformer", "vae"):
        tensors = load_file(TINY_LATTE_DIR / part / "diffusion_pytorch_model.safetensors")
        assert sum(t.numel() for t in tensors.values()) == record[f"{part}_parameters"], part
        assert all(torch.isfinite(t).all() for t in tensors.values()), part
    assert record["seed"] == 0 and record["training_clips"] == 40 * record["clips_per_prompt"]
    assert 0 < record["final_loss"] < 0.5 and 0 < record["seconds"]["total"] < 30 * 60   # v MSE, unweighted
    assert set(record["versions"]) >= {"torch", "diffusers", "transformers", "numpy", "python"}
    # the committed run predates the script's move to tools/weights/; a new run records the new path
    assert record["command"].split()[2] in ("weights.train_tiny_latte", "tools.weights.train_tiny_latte")


# --- validation errors ----------------------------------------------------------------------
def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-ckpt"
    with pytest.raises(FileNotFoundError) as ei:
        resolve_latte(missing)
    assert str(missing) in str(ei.value)
    assert "tiny-latte" in str(ei.value)  # lists the known names


def test_unknown_short_name_lists_known_names():
    with pytest.raises(FileNotFoundError, match="tiny-latte") as ei:
        resolve_latte("tiny-lattte")
    assert "'tiny-lattte'" in str(ei.value) and "known names" in str(ei.value)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_latte(f)


def test_missing_model_index(tiny_copy):
    (tiny_copy / "model_index.json").unlink()
    with pytest.raises(FileNotFoundError, match="model_index.json") as ei:
        resolve_latte(tiny_copy)
    assert str(tiny_copy) in str(ei.value)


def test_model_index_not_json(tiny_copy):
    (tiny_copy / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model_index.json .* not valid JSON"):
        resolve_latte(tiny_copy)


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder", "tokenizer", "scheduler"])
def test_missing_component_folder(tiny_copy, component):
    shutil.rmtree(tiny_copy / component)
    with pytest.raises(FileNotFoundError) as ei:
        resolve_latte(tiny_copy)
    msg = str(ei.value)
    assert f"{component}/ is missing" in msg and str(tiny_copy / component) in msg


def test_component_missing_from_model_index(tiny_copy):
    index = json.loads((tiny_copy / "model_index.json").read_text())
    del index["vae"]
    (tiny_copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="component 'vae'"):
        resolve_latte(tiny_copy)


@pytest.mark.parametrize(
    "component,config", [("transformer", "config.json"), ("vae", "config.json"),
                         ("text_encoder", "config.json"), ("scheduler", "scheduler_config.json")]
)
def test_missing_config(tiny_copy, component, config):
    (tiny_copy / component / config).unlink()
    with pytest.raises(FileNotFoundError) as ei:
        resolve_latte(tiny_copy)
    msg = str(ei.value)
    assert f"{component} config is missing" in msg and str(tiny_copy / component / config) in msg


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder"])
def test_missing_weights(tiny_copy, component):
    for p in (tiny_copy / component).glob("*.safetensors"):
        p.unlink()
    with pytest.raises(FileNotFoundError) as ei:
        resolve_latte(tiny_copy)
    msg = str(ei.value)
    assert f"{component} weights are missing" in msg and str(tiny_copy / component) in msg


def test_bin_weights_are_accepted(tiny_copy):
    for p in (tiny_copy / "vae").glob("*.safetensors"):
        p.rename(p.with_suffix(".bin"))
    assert resolve_latte(tiny_copy) == tiny_copy.resolve()


def test_missing_tokenizer_vocab(tiny_copy):
    for name in ("tokenizer.json", "spiece.model"):
        (tiny_copy / "tokenizer" / name).unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer vocabulary is missing"):
        resolve_latte(tiny_copy)


def test_wrong_pipeline_class(tiny_copy):
    index = json.loads((tiny_copy / "model_index.json").read_text())
    index["_class_name"] = "PixArtAlphaPipeline"
    (tiny_copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as ei:
        resolve_latte(tiny_copy)
    msg = str(ei.value)
    assert "'PixArtAlphaPipeline'" in msg and "LattePipeline" in msg and "model_index.json" in msg


def test_wrong_transformer_class(tiny_copy):
    cfg_path = tiny_copy / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_class_name"] = "PixArtTransformer2DModel"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as ei:
        resolve_latte(tiny_copy)
    msg = str(ei.value)
    assert "'PixArtTransformer2DModel'" in msg and "LatteTransformer3DModel" in msg and str(cfg_path) in msg


# --- a Latte-1-shaped checkpoint -------------------------------------------------------------
def test_latte1_shaped_checkpoint(tmp_path, offline):
    from latte_models import build_latte1_shaped_checkpoint

    assert LATTE_1_TRANSFORMER_CONFIG == LATTE_1
    ckpt = build_latte1_shaped_checkpoint(tmp_path / "latte-1-shaped")

    assert resolve_latte(ckpt) == ckpt.resolve()
    assert resolve_latte(str(ckpt)) == ckpt.resolve()

    loaded = _load(ckpt)
    cfg = {k: v for k, v in loaded.transformer.config.items() if not k.startswith("_")}
    assert cfg == {**LATTE_1, "num_layers": 1}
    assert loaded.text_encoder.config.d_model == cfg["caption_channels"] == 4096
    assert sum(p.numel() for p in loaded.transformer.parameters()) > 40_000_000

    # End to end once at a small size: 16 frames of 64x64 -> 8x8 latents (pos-embed interpolated
    # from sample_size 64), 4096-wide prompt embeddings through the caption projection.
    out = loaded(prompt="a red ball", video_length=16, height=64, width=64, num_inference_steps=1,
                 guidance_scale=1.0, output_type="latent", clean_caption=False,
                 generator=torch.Generator("cpu").manual_seed(0)).frames
    assert out.shape == (1, 4, 16, 8, 8) and torch.isfinite(out).all()

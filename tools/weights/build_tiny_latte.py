"""Build a tiny, randomly initialised Latte checkpoint (the untrained sibling of ``weights/tiny-latte``).

Usage::

    python -m tools.weights.build_tiny_latte --out DIR  # writes DIR (weights/tiny-latte itself is trained:
                                                   # python -m tools.weights.train_tiny_latte)

The shipped ``weights/tiny-latte`` is made by ``tools.weights.train_tiny_latte``, which takes its
tokenizer, text encoder and scheduler from here (the text encoder frozen, so it is byte-identical
to this build's); this builder stays for tests and benchmarks that want random weights.

The result is a complete diffusers-format ``LattePipeline`` directory (model_index.json plus
transformer/, vae/, text_encoder/, tokenizer/, scheduler/) that loads with
``diffusers.LattePipeline.from_pretrained(DIR)`` fully offline: nothing is downloaded, neither
while building nor while loading.  Everything is deterministic: the same library versions give
byte-identical files on every run (the weights depend only on ``SEED``, never on torch's
default initialisers or global RNG state).

What is in it (Latte-1's structure, tiny sizes):

* transformer: ``LatteTransformer3DModel`` with Latte-1's options (learned sigma, i.e.
  out_channels = 2 x in_channels; ada_norm_single; gelu-approximate; no elementwise affine;
  attention bias; 1000 ada-norm embeddings; 16-frame temporal position table) but 3 heads x 8
  dims (inner dim 24; 3 is deliberately odd, so head counts divide by neither 2 nor 4),
  2 spatial + 2 temporal blocks, sample_size 8 (a 64x64 video -> 8x8 latent -> 4x4 patches).
* vae: ``AutoencoderKL`` with 4 latent channels and 4 down blocks (8x spatial downsampling,
  like SD's VAE), channels (16, 16, 32, 32), one layer per block, SD's scaling factor 0.18215.
* text_encoder: ``T5EncoderModel`` (T5 v1.1 style: gated-gelu, untied embeddings, no
  bias), d_model 32 (= the transformer's caption_channels), 4 heads x 8, d_ff 64, 2 layers.
* tokenizer: a T5 tokenizer whose vocabulary is a sentencepiece unigram model trained here,
  single-threaded, on the small built-in English corpus ``CORPUS`` (248 pieces with T5's
  ``<pad>``=0, ``</s>``=1, ``<unk>``=2, no BOS) followed by 8 ``<extra_id_N>`` sentinels in T5's
  (reversed) order: 256 ids, equal to the text encoder's vocab_size.  Both ``tokenizer.json``
  (what transformers 5 reads) and ``spiece.model`` (for sentencepiece-based T5Tokenizer, e.g.
  transformers 4) are written.  model_max_length is 120, the prompt length LattePipeline
  pads/truncates to.
* scheduler: ``DDIMScheduler`` with Latte-1's sampling settings as published in the official
  repository (Vchitect/Latte, configs/t2x/t2v_sample.yaml and sample/sample_t2x.py):
  linear betas 0.0001 -> 0.02, 1000 training steps, epsilon prediction, clip_sample=False.  The
  repository also passes variance_type="learned_range", which DDIMScheduler does not accept
  (it would be dropped with a warning), so it is left out; LattePipeline then keeps the first
  half (epsilon) of the 8-channel transformer output, as it does for Latte-1.  The remaining
  options keep DDIMScheduler's defaults.

After construction every parameter -- including the ones diffusers initialises to zero
(proj_out, scale_shift_table, adaLN, ...) -- is redrawn from a seeded normal distribution
(std = 1/sqrt(fan_in) clamped to [0.02, 0.2] for matrices, small noise around 0 or 1 for
vectors), so the transformer output is O(1) and depends visibly on the prompt, the timestep and
every block.  The weights are meaningless: the checkpoint exists to exercise loading, shapes,
parallel execution and serving, not to make pretty videos.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import torch

from tools.weights.seeded import reinit_
from tools.weights.writing import report, write_whole

SEED = 0

# --- text side -----------------------------------------------------------------------------
SP_VOCAB_SIZE = 248  # sentencepiece pieces, including <pad>, </s>, <unk>
EXTRA_IDS = 8  # T5 sentinels <extra_id_0..7>, appended in reverse like T5
VOCAB_SIZE = SP_VOCAB_SIZE + EXTRA_IDS  # 256 == text encoder vocab_size
TOKENIZER_MAX_LENGTH = 120  # LattePipeline.encode_prompt pads/truncates to 120 tokens

T5_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",  # T5 v1.1 (Latte-1 uses t5-v1_1-xxl)
    tie_word_embeddings=False,
    is_encoder_decoder=False,
    use_cache=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

# --- transformer ---------------------------------------------------------------------------
TRANSFORMER_CONFIG = dict(
    num_attention_heads=3,
    attention_head_dim=8,
    in_channels=4,
    out_channels=8,
    num_layers=2,
    dropout=0.0,
    cross_attention_dim=24,  # == inner dim, as in Latte-1 (1152 == 16 x 72)
    attention_bias=True,
    sample_size=8,
    patch_size=2,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_type="ada_norm_single",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=T5_CONFIG["d_model"],
    video_length=16,
)

# --- vae -----------------------------------------------------------------------------------
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(16, 16, 32, 32),
    layers_per_block=1,
    act_fn="silu",
    latent_channels=4,
    norm_num_groups=8,
    sample_size=64,
    scaling_factor=0.18215,
)

# --- scheduler -----------------------------------------------------------------------------
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.0001,
    beta_end=0.02,
    beta_schedule="linear",
    prediction_type="epsilon",
    clip_sample=False,
)

# A small, fixed English corpus of video-caption-like sentences for the tokenizer.
CORPUS = (
    "a red ball bouncing on a wooden floor",
    "a blue ball rolling slowly across the grass",
    "a cat wearing sunglasses and working as a lifeguard at the pool",
    "a dog in an astronaut suit floating in space",
    "yellow and black tropical fish dart through the sea",
    "an epic tornado attacking above a glowing city at night",
    "slow pan upward of a blazing oak fire in an indoor fireplace",
    "sunset over the sea with gentle waves",
    "a panda eating bamboo in a quiet forest",
    "a teddy bear playing the piano in times square",
    "a horse running through a snowy field at dawn",
    "waves crashing against the rocks on a stormy day",
    "a time lapse of clouds moving over the mountains",
    "a busy street in tokyo with neon lights in the rain",
    "an astronaut riding a horse on the moon",
    "a little girl blowing bubbles in the park",
    "a train passing through a green valley",
    "fireworks exploding over a river at night",
    "a bird flying over a calm lake in the morning",
    "a car driving along a coastal road at sunset",
    "rain falling on the window of a small cafe",
    "a chef cooking pasta in a bright kitchen",
    "a robot walking through an abandoned factory",
    "a butterfly landing on a purple flower",
    "a man surfing a huge wave in the ocean",
    "two friends laughing and walking on the beach",
    "a golden retriever catching a frisbee in the backyard",
    "a candle flickering in a dark room",
    "snow falling gently on a pine forest",
    "a hot air balloon rising above the desert",
    "a boat sailing across a crystal clear lake",
    "an old man reading a newspaper on a bench",
    "a squirrel gathering nuts under a tall tree",
    "the milky way rotating above a mountain lake",
    "a close up of coffee being poured into a white cup",
    "children playing football in a dusty village",
    "a dragon flying over a medieval castle",
    "a spaceship landing on a red planet",
    "a jellyfish glowing in the deep blue water",
    "leaves falling from the trees in autumn",
    "a woman dancing in the rain under a street lamp",
    "a lighthouse shining its light over the dark sea",
    "a waterfall flowing into a misty river",
    "a city skyline with tall buildings at twilight",
    "a kitten chasing a ball of yarn",
    "a drone shot of a winding river through the jungle",
    "an elephant walking across the savanna",
    "a field of sunflowers swaying in the wind",
    "a glass of water falling and shattering on the floor",
    "a volcano erupting with bright orange lava",
    "a penguin sliding on the ice",
    "a skateboarder doing a trick in the park",
    "a cup of tea steaming on a table by the window",
    "a fox running through the snow",
    "a street musician playing guitar for a crowd",
    "the northern lights dancing over a frozen lake",
    "a bee collecting pollen from a yellow flower",
    "a rocket launching into a clear blue sky",
    "an owl turning its head in the moonlight",
    "a painter painting a colorful picture of a garden",
    "a small boat drifting on a foggy river",
    "a cowboy riding a horse in the wild west",
    "a plate of fresh fruit on a kitchen table",
    "an underwater scene with colorful coral and turtles",
    "a train station crowded with people in the evening",
    "a tiger walking slowly through tall green grass",
    "a paper plane flying across a classroom",
    "smoke rising from a chimney in a snowy village",
    "a group of dolphins jumping out of the water",
    "a vintage car parked in front of a diner",
    "a man playing the violin on a rooftop",
    "lightning striking a tree during a thunderstorm",
    "a timelapse of a flower blooming",
    "a happy family having a picnic in the park",
    "a mouse eating cheese in a cozy kitchen",
    "a quiet library with rows of old books",
    "a soccer ball flying into the goal",
    "a swan swimming gracefully across a pond",
    "the camera zooms in on a spinning globe",
    "a knight in shining armor holding a sword",
)


# ------------------------------------------------------------------------------------------
def train_spiece_model(corpus=CORPUS, vocab_size: int = SP_VOCAB_SIZE) -> bytes:
    """Train the tokenizer's sentencepiece unigram model (deterministic: one thread)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=buf,
        model_type="unigram",
        vocab_size=vocab_size,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        character_coverage=1.0,
        # No NFKC char map: keeps tokenizer.json (tokenizers backend) and spiece.model equivalent.
        normalization_rule_name="identity",
        num_threads=1,
        seed_sentencepiece_size=100000,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buf.getvalue()


def build_tokenizer(spiece_model: bytes | None = None):
    """Return (T5Tokenizer, spiece_model_bytes) with T5's special-token layout."""
    import sentencepiece as spm
    from transformers import T5Tokenizer

    if spiece_model is None:
        spiece_model = train_spiece_model()
    sp = spm.SentencePieceProcessor(model_proto=spiece_model)
    if sp.get_piece_size() != SP_VOCAB_SIZE:
        raise RuntimeError(f"sentencepiece produced {sp.get_piece_size()} pieces, expected {SP_VOCAB_SIZE}")
    vocab = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    assert [v[0] for v in vocab[:3]] == ["<pad>", "</s>", "<unk>"], vocab[:3]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(EXTRA_IDS))]
    tok = T5Tokenizer(vocab=vocab, extra_ids=EXTRA_IDS, model_max_length=TOKENIZER_MAX_LENGTH)
    if len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tok)} ids, expected {VOCAB_SIZE}")
    return tok, spiece_model


def build_text_encoder(seed: int = SEED + 1, **overrides):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(**{**T5_CONFIG, **overrides})
    model = T5EncoderModel(cfg).eval()
    return reinit_(model, seed)


def build_transformer(seed: int = SEED + 2, **overrides):
    from diffusers import LatteTransformer3DModel

    model = LatteTransformer3DModel(**{**TRANSFORMER_CONFIG, **overrides}).eval()
    return reinit_(model, seed)


def build_vae(seed: int = SEED + 3, **overrides):
    from diffusers import AutoencoderKL

    model = AutoencoderKL(**{**VAE_CONFIG, **overrides}).eval()
    return reinit_(model, seed)


def build_scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(**SCHEDULER_CONFIG)


def build_pipeline():
    """Construct the tiny LattePipeline in memory; returns (pipeline, spiece_model_bytes)."""
    from diffusers import LattePipeline

    torch.manual_seed(SEED)  # only affects default inits, which reinit_ overwrites anyway
    tokenizer, spiece_model = build_tokenizer()
    text_encoder = build_text_encoder()
    transformer = build_transformer()
    vae = build_vae()
    scheduler = build_scheduler()
    pipe = LattePipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    return pipe, spiece_model


def write_pipeline(out_dir: Path) -> None:
    try:  # no "Writing model shards" progress bars in the build log
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass
    pipe, spiece_model = build_pipeline()
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "tokenizer" / "spiece.model").write_bytes(spiece_model)


def build(out: str | Path) -> Path:
    """Build the checkpoint into ``out`` (replacing a previous build there, whole: `write_whole`) and return it."""
    return write_whole(out, write_pipeline)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_latte", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True,
                    help="output directory (not weights/tiny-latte: that one is trained, train_tiny_latte)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report(build(args.out), time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

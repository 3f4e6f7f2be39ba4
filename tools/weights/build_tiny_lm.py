"""Build `weights/tiny-lm/`: a tiny Llama causal LM with a byte-level BPE tokenizer.

    python -m tools.weights.build_tiny_lm [--out DIR] [--seed 0]

Architecture: Llama with grouped-query attention (4 query heads, 2 KV heads), RoPE,
hidden 64, 2 layers, max_position_embeddings 4096, vocabulary 384 (256 byte symbols,
125 merges learned from the built-in corpus below, and <s>, </s>, <pad>).

The weights are random (no training: nothing is downloaded and the build takes a
second), drawn from one `torch.Generator(seed)` in sorted parameter-name order, so the
same seed gives a byte-identical model.safetensors on any machine. They are scaled up
from the usual 0.02 so that the model's next-token distributions are far from uniform
and its attention far from flat: a wrong causal mask, a wrong position id or a lost
token changes the NLL by much more than float rounding, which is what the scoring
tests need.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from longserve.weights.lm import TINY_LM_DIR

CORPUS = """\
A long text is a sequence of tokens, and a causal language model reads it from left to right.
At every position the model predicts the next token from all the tokens before it.
The negative log-likelihood of the text is the sum of the surprise at every step.
Perplexity is the exponential of the mean surprise; bits per byte divide by the bytes of the text.
When a text is too long for one worker, we split it into segments, one segment per worker.
Each worker keeps the queries of its own segment and gathers the keys and values of all the others.
The causal mask compares global positions: a key may be seen when its position is not after the query.
Zigzag sharding gives rank r the chunks r and 2N-1-r, so every worker does the same amount of work.
The ring variant passes blocks of keys and values from neighbour to neighbour and merges them
with a running maximum and a running sum, the online softmax, so no worker holds the whole sequence.
Numbers appear too: 0 1 2 3 4 5 6 7 8 9, 10, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
In the beginning the workers start, load the model once, and wait for jobs from the coordinator.
The coordinator sends the same job to every worker, and the workers run it in lockstep.
def score(text): return sum(-log p(token | prefix) for token in text)  # in nats, float64
Rivers run to the sea, yet the sea is not full; the wind goes round and returns again.
"""

VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
    vocab_size=VOCAB_SIZE,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    initializer_range=0.02,
)

# Standard deviation of each weight kind (see the module docstring for why not 0.02).
_STD = {
    "embed_tokens": 1.0,
    "q_proj": 2.0,   # x fan_in^-1/2: peaky attention
    "k_proj": 2.0,
    "v_proj": 1.0,
    "o_proj": 1.0,
    "gate_proj": 1.0,
    "up_proj": 1.0,
    "down_proj": 1.0,
    "lm_head": 3.0,  # logits of std ~3: confident, non-uniform predictions
}


def build_tokenizer():
    """Byte-level BPE trained on CORPUS (deterministic), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=CONFIG["max_position_embeddings"],
    )


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            kind = name.split(".")[-2]
            std = _STD[kind]
            if p.ndim == 2 and kind != "embed_tokens":
                std = std / math.sqrt(p.shape[1])  # fan-in scaling: unit-variance outputs
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def build(out: Path = TINY_LM_DIR, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    if len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(t) == i, (t, i)
    model = build_model(seed)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The generic class name loads with AutoTokenizer on transformers 4.x and 5.x alike.
    tok_config_file = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_file.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_file.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    build_info = {"built_by": "python -m tools.weights.build_tiny_lm", "seed": seed}
    (out / "BUILD.json").write_text(json.dumps(build_info, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_lm", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=TINY_LM_DIR, help="output directory (default: weights/tiny-lm)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = build(args.out, args.seed)
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

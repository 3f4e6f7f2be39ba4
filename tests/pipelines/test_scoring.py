"""TextScoringPipeline / `longserve score`: sequence-sharded scoring equals transformers' own.

Every number is compared with transformers' own model run in this process on the same
checkpoint (`model(ids, labels=ids)`, SDPA attention): nothing is compared with itself.
One worker pool per worker count for the whole module.
"""

import io
import json
import math
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from longserve.pipelines import TextScoringPipeline
from longserve.server.cli import main as cli_main
from longserve.weights.lm import resolve_causal_lm
from tests.support.checkpoints import assert_same_file
from tools.weights.build_tiny_lm import CORPUS

TINY = resolve_causal_lm("tiny-lm")
RTOL = 1e-5


# -- references, computed here with transformers alone ------------------------------------


@pytest.fixture(scope="module")
def hf():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY).eval()  # transformers' default attention
    return tokenizer, model


def ids_with_bos(tokenizer, text):
    return [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def hf_full(model, ids):
    """(total NLL = mean loss x scored tokens, per-token log-probs) by transformers alone."""
    x = torch.tensor([ids])
    out = model(input_ids=x, labels=x)
    logprobs = torch.log_softmax(out.logits[0].float(), -1)[torch.arange(len(ids) - 1), x[0, 1:]]
    return float(out.loss) * (len(ids) - 1), logprobs.double()


@torch.inference_mode()
def hf_guide_sliding_window(model, ids, window, stride):
    """The Hugging Face perplexity guide's loop, verbatim in spirit: (total NLL, tokens)."""
    x = torch.tensor([ids])
    seq_len = x.shape[1]
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + window, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = x[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        loss = model(input_ids=input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())  # the labels the loss averaged over
        nll_sum += float(loss) * scored
        n_tokens += scored
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


def text_whose_length_divides_by_nothing(tokenizer, approx_tokens=400):
    """A text whose token count with BOS shares no factor with 2, 3, 4 (or zigzag's 2N)."""
    base = CORPUS * 2
    for cut in range(2 * approx_tokens, len(base)):
        n = len(ids_with_bos(tokenizer, base[:cut]))
        if n > approx_tokens and math.gcd(n, 12) == 1:
            return base[:cut]
    raise AssertionError("no such text")


@pytest.fixture(scope="module")
def text(hf):
    return text_whose_length_divides_by_nothing(hf[0])


@pytest.fixture(scope="module")
def scorer_for():
    pools = {}

    def get(workers):
        if workers not in pools:
            pools[workers] = TextScoringPipeline.from_pretrained("tiny-lm", workers=workers)
        return pools[workers]

    yield get
    for p in pools.values():
        p.close()


# -- the model and its resolver ---------------------------------------------------------------


def test_tiny_lm_is_a_small_gqa_llama_that_rebuilds_byte_identically(tmp_path, hf):
    from tools.weights.build_tiny_lm import build

    config = hf[1].config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.max_position_embeddings == 4096 and 256 < config.vocab_size < 1000
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 5_000_000
    build(tmp_path / "a", seed=0)
    for name in ("tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (TINY / name).read_bytes(), name
    # the weights: byte-identical on the CPU kernels they were built with, within float rounding on others
    assert_same_file(tmp_path / "a" / "model.safetensors", TINY / "model.safetensors")
    build(tmp_path / "b", seed=1)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != (TINY / "model.safetensors").read_bytes()


def test_resolver_names_what_is_missing(tmp_path):
    assert resolve_causal_lm("tiny-lm") == TINY
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_causal_lm(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_causal_lm(str(tmp_path))
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights"):
        resolve_causal_lm(str(tmp_path))
    shutil.copy(TINY / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        resolve_causal_lm(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="model_type"):
        resolve_causal_lm(str(tmp_path))


# -- exactness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_total_nll_and_token_logprobs_match_transformers_for_every_strategy(workers, scorer_for, hf, text):
    tokenizer, model = hf
    ids = ids_with_bos(tokenizer, text)
    assert math.gcd(len(ids), 12) == 1  # the sharded length divides by none of N, 2N
    want_total, want_logprobs = hf_full(model, ids)
    scorer = scorer_for(workers)
    # lss with both attention kernels (the online-softmax blocks, CPU's default; torch's SDPA with a
    # lower-right causal mask, CUDA's default); ring merges blocks whatever the kernel
    for strategy, kernel in (("lss", "blocks"), ("lss", "sdpa"), ("ring", None)):
        for zigzag in (False, True):
            r = scorer.score(text, strategy=strategy, zigzag=zigzag, return_token_logprobs=True, attn_kernel=kernel)
            where = f"{strategy}, attn_kernel={kernel}, zigzag={zigzag}, {workers} workers"
            assert r.num_tokens == len(ids) - 1 == len(tokenizer(text, add_special_tokens=False)["input_ids"]), where
            assert abs(r.total_nll - want_total) <= RTOL * abs(want_total), where
            torch.testing.assert_close(torch.tensor(r.token_logprobs, dtype=torch.float64), want_logprobs,
                                       rtol=1e-5, atol=1e-5, msg=where)
            assert r.token_ids == ids[1:], where
            assert r.num_bytes == len(text.encode("utf-8"))
            assert r.mean_nll == pytest.approx(want_total / (len(ids) - 1), rel=RTOL)
            assert r.bits_per_byte == pytest.approx(want_total / (math.log(2) * len(text.encode("utf-8"))), rel=RTOL)
            assert r.perplexity == pytest.approx(math.exp(want_total / (len(ids) - 1)), rel=1e-4)


def test_a_text_shorter_than_the_worker_count_leaves_some_workers_only_padding(scorer_for, hf):
    tokenizer, model = hf
    text = "Hi"
    ids = ids_with_bos(tokenizer, text)
    assert len(ids) < 4
    want_total, _ = hf_full(model, ids)
    for strategy, zigzag in [("lss", False), ("ring", False), ("lss", True), ("ring", True)]:
        r = scorer_for(4).score(text, strategy=strategy, zigzag=zigzag)
        assert r.num_tokens == len(ids) - 1
        assert abs(r.total_nll - want_total) <= RTOL * want_total


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_byte_accounting_shows_one_fused_kv_all_gather_per_layer_or_n_minus_1_ring_steps(workers, scorer_for, hf, text):
    config = hf[1].config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.head_dim
    T = len(ids_with_bos(hf[0], text))
    local = -(-T // workers)  # contiguous shard, padded
    kv_bytes = local * 2 * kv_heads * head_dim * 4  # K and V, un-repeated KV heads, fp32
    reduce_bytes = round(2 * 16 * (workers - 1) / workers)  # one float64 [nll_sum, count]
    lss_run = scorer_for(workers).score(text, strategy="lss")
    ring_run = scorer_for(workers).score(text, strategy="ring")
    for stats in lss_run.comm:
        assert stats["calls"] == {"all_gather": layers, "all_reduce": 1}
        assert stats["bytes_sent"] == layers * (workers - 1) * kv_bytes + reduce_bytes
    for stats in ring_run.comm:
        assert stats["calls"] == {"send_recv": layers * (workers - 1), "all_reduce": 1}
        assert stats["bytes_sent"] == layers * (workers - 1) * kv_bytes + reduce_bytes


def test_progress_reports_every_layer_of_every_window(scorer_for, text, hf):
    calls = []
    r = scorer_for(2).score(text, window=256, stride=128, progress=lambda done, total: calls.append((done, total)))
    total = r.windows * hf[1].config.num_hidden_layers
    assert r.windows > 1
    assert [d for d, _ in calls] == list(range(1, total + 1)) and {t for _, t in calls} == {total}


# -- sliding windows ------------------------------------------------------------------------------


def test_window_at_least_the_text_length_is_full_scoring(scorer_for, text):
    scorer = scorer_for(3)
    full = scorer.score(text, strategy="ring", zigzag=True)
    windowed = scorer.score(text, window=4096, stride=100, strategy="ring", zigzag=True)
    assert windowed.windows == 1
    assert (windowed.total_nll, windowed.num_tokens) == (full.total_nll, full.num_tokens)


@pytest.mark.parametrize("window,stride", [(160, 64), (128, 128)])
def test_sliding_windows_match_the_hf_perplexity_guide_loop(window, stride, scorer_for, hf, text):
    tokenizer, model = hf
    want_nll, want_tokens = hf_guide_sliding_window(model, ids_with_bos(tokenizer, text), window, stride)
    for workers, strategy, zigzag in [(3, "lss", False), (4, "ring", True)]:
        r = scorer_for(workers).score(text, window=window, stride=stride, strategy=strategy, zigzag=zigzag)
        assert r.num_tokens == want_tokens
        assert abs(r.total_nll - want_nll) <= RTOL * want_nll, (workers, strategy)


def test_text_longer_than_the_model_scores_with_windows_and_is_refused_without(scorer_for, hf):
    tokenizer, model = hf
    text = CORPUS * 6
    ids = ids_with_bos(tokenizer, text)
    assert len(ids) > model.config.max_position_embeddings
    scorer = scorer_for(4)
    with pytest.raises(ValueError, match=r"text.*4096.*window") as e:
        scorer.score(text)
    assert e.value.field == "text"
    want_nll, want_tokens = hf_guide_sliding_window(model, ids, 2048, 1024)
    r = scorer.score(text, window=2048, stride=1024, zigzag=True)
    assert r.num_tokens == want_tokens == len(ids) - 1
    assert abs(r.total_nll - want_nll) <= RTOL * want_nll


# -- other architectures through transformers' attention interface -------------------------------------


def _save_random_causal_lm(path, config, seed=0):
    """A transformers checkpoint with fan-in-scaled random weights and tiny-lm's tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1.0 if "embed" in name else 1.5 / math.sqrt(p.shape[1]))
            elif "bias" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, path / f)
    return path


@pytest.mark.parametrize("arch", ["mistral-sliding-window", "qwen2-attention-bias"])
def test_other_transformers_architectures_load_and_match(arch, tmp_path, text):
    from transformers import MistralConfig, Qwen2Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=384, max_position_embeddings=4096, bos_token_id=0)
    if arch.startswith("mistral"):
        config = MistralConfig(sliding_window=48, **common)  # attention window shorter than the text
    else:
        config = Qwen2Config(**common)
    path = _save_random_causal_lm(tmp_path / arch, config)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)  # transformers picks the class by model type (Qwen2Tokenizer)
    ids = ids_with_bos(tokenizer, text)
    want_total, _ = hf_full(model, ids)
    with TextScoringPipeline.from_pretrained(str(path), workers=2) as scorer:
        for strategy, zigzag in [("lss", False), ("ring", True)]:
            r = scorer.score(text, strategy=strategy, zigzag=zigzag)
            assert r.num_tokens == len(ids) - 1
            assert abs(r.total_nll - want_total) <= RTOL * want_total, (strategy, zigzag)


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_raises_value_errors_naming_the_field(scorer_for):
    scorer = scorer_for(1)
    restarts = scorer.pool.restarts
    cases = [
        (dict(text=""), "text"),
        (dict(text=None), "text"),
        (dict(text="a lone surrogate \ud800"), "text"),     # no tokenizer encodes it (issue 32)
        (dict(text="abc", strategy="megatron"), "strategy"),
        (dict(text="abc", zigzag="yes"), "zigzag"),
        (dict(text="abc", window=8000, stride=10), "window"),
        (dict(text="abc", window=1, stride=1), "window"),
        (dict(text="abc", stride=10), "stride"),
        (dict(text="abc", window=100), "stride"),
        (dict(text="abc", window=100, stride=101), "stride"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field) as e:
            scorer.score(**kwargs)
        assert e.value.field == field, kwargs
    for kwargs, field in [(dict(workers=0), "workers"), (dict(workers=-2), "workers"),
                          (dict(strategy="ulysses"), "strategy"), (dict(dtype="int8"), "dtype"),
                          (dict(device="tpu"), "device")]:
        with pytest.raises(ValueError, match=field):
            TextScoringPipeline.from_pretrained("tiny-lm", **kwargs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextScoringPipeline.from_pretrained("/no/such/model")
    assert scorer.score("abc").num_tokens > 0  # the pool is still fine
    assert scorer.pool.restarts == restarts


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_refuses_non_utf8_file_and_missing_model_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert cli_main(["score", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "UTF-8" in err
    good = tmp_path / "good.txt"
    good.write_text("hello")
    assert cli_main(["score", str(good), "--model", str(tmp_path / "no-model")]) == 2
    assert "no-model" in capsys.readouterr().err
    assert cli_main(["score", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli_main(["score", str(empty)]) == 2
    assert "text is empty" in capsys.readouterr().err


def test_cli_scores_stdin_as_json(monkeypatch, capsys, hf, text):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8"))))
    assert cli_main(["score", "-", "--workers", "1", "--strategy", "ring", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want_total, _ = hf_full(hf[1], ids_with_bos(hf[0], text))
    assert out["num_tokens"] == len(ids_with_bos(hf[0], text)) - 1
    assert abs(out["total_nll"] - want_total) <= RTOL * want_total
    assert out["bits_per_byte"] == pytest.approx(want_total / (math.log(2) * len(text.encode())), rel=RTOL)


def _all_gather_after_failing_on_rank_1(ctx, how):
    """Rank 1 fails while its peers wait for it in an all-gather (the fused K/V exchange's collective)."""
    from longserve.engine import comm

    if ctx.pg.rank == 1:
        if how == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory")
        if how == "exit":
            import os

            os._exit(3)
        raise RuntimeError("a bug on one rank")
    return comm.all_gather(torch.ones(2), 0, ctx.pg)


@pytest.mark.parametrize("how, kind", [("raise", "internal"), ("oom", "out_of_memory"), ("exit", "worker_died")])
def test_a_failure_on_one_scoring_worker_restarts_the_pool_and_the_next_score_is_exact(how, kind, scorer_for, hf,
                                                                                       text):
    from longserve.engine.pool import WorkerError

    scorer = scorer_for(2)
    restarts = scorer.pool.restarts
    scorer.pool.error_grace_s = 1.0          # how long the pool waits for rank 0, stuck in the all-gather
    with pytest.raises(WorkerError) as e:
        scorer.pool.run(_all_gather_after_failing_on_rank_1, how)
    assert (e.value.kind, e.value.rank) == (kind, 1)
    assert scorer.pool.restarts == restarts + 1, "a collective may be pending: the pool must not be reused as is"
    tokenizer, model = hf
    want_total, _ = hf_full(model, ids_with_bos(tokenizer, text))
    assert abs(scorer.score(text).total_nll - want_total) <= RTOL * abs(want_total)

"""`attention_backend` (engine/attention.py): diffusers' dispatcher backends, chosen per engine.

On CPU: "native" gives the default's output bit for bit; a chosen backend is what runs in every attention of a
step (diffusers' cross-attention and our sequence-parallel self-attention alike); a backend that is not installed,
does not run on the device, or meets a plan that merges attention itself is refused before any worker starts,
naming the field, through Python, the CLI and the server's config. The kernels themselves (flash, _flash_3, sage,
cuDNN) are timed on a GPU by `longserve bench gpu --sections backends`."""

import pytest
import torch

from longserve.engine.config import EngineConfig
from longserve.engine.dist import ParallelGroup
from longserve.engine.models.wan import WanSequenceParallel
from longserve.engine.parallel import make_sequence_parallel
from tools.bench.models import random_wan_transformer

SOLO = ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def process_backend_restored():
    """diffusers' `set_attention_backend` also sets the process's active backend (for every model after it): put it
    back, or a later test's plain diffusers forward in this process runs this module's last backend."""
    from longserve.engine.attention import keeping_active_backend

    with keeping_active_backend():
        yield


def wan_step(backend: str | None, frames_per_block: int = 1) -> torch.Tensor:
    """One forward of a tiny random Wan transformer as a one-worker engine runs it, under `backend`."""
    model = random_wan_transformer(heads=3, skyreels=frames_per_block > 1, frames_per_block=frames_per_block)
    if backend is not None:
        model.set_attention_backend(backend)             # what the load pipeline does (engine/families/base.py)
    g = torch.Generator().manual_seed(1)
    x, t, text = torch.randn(2, 4, 4, 6, 10, generator=g), torch.tensor([900.0, 300.0]), torch.randn(2, 5, 16,
                                                                                                      generator=g)
    sp = make_sequence_parallel(SOLO, "ulysses", attention_backend=backend)
    with torch.no_grad():
        return WanSequenceParallel(model)(x, t, text, sp, frames_per_block=frames_per_block)


def test_native_is_the_default_bit_for_bit_and_the_chosen_backend_runs_every_attention(monkeypatch):
    from diffusers.models import attention_dispatch as dispatch

    default = wan_step(None)
    assert torch.equal(wan_step("native"), default)
    calls = []
    name = dispatch.AttentionBackendName._NATIVE_MATH
    math = dispatch._AttentionBackendRegistry._backends[name]
    monkeypatch.setitem(dispatch._AttentionBackendRegistry._backends, name,
                        lambda **kw: calls.append((kw["query"].shape[1], kw["key"].shape[1])) or math(**kw))
    got = wan_step("_native_math")
    torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-5)
    # 2 blocks x (self-attention of the 4 x 3 x 5 = 60 tokens: ours; cross-attention to the 5 text tokens: theirs)
    assert calls == [(60, 60), (60, 5)] * 2
    calls.clear()                          # diffusion forcing's block-causal attention: 2 frames (30 tokens) a block
    wan_step("_native_math", frames_per_block=2)
    assert calls == [(30, 30), (30, 60), (60, 5)] * 2


def test_a_backend_that_cannot_run_is_refused_before_any_worker_naming_the_field(monkeypatch):
    import longserve.engine.engine as engine_module
    from longserve.pipelines import VideoPipeline

    def no_workers(*args, **kwargs):
        raise AssertionError("the workers were started before attention_backend was checked")

    monkeypatch.setattr(engine_module, "make_pool", no_workers)
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*native.*; got 'fast'"):
        EngineConfig(attention_backend="fast")
    assert EngineConfig(attention_backend="none").attention_backend is None
    with pytest.raises(ValueError, match=r"attention_backend='flash_hub' downloads its kernel"):
        EngineConfig(attention_backend="flash_hub")
    with pytest.raises(ValueError, match=r"attention_backend='flash' is not usable here: .*flash-attn"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", attention_backend="flash")
    with pytest.raises(ValueError, match=r"attention_backend='_native_cudnn' does not run on cpu with dtype float32"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", attention_backend="_native_cudnn")
    with pytest.raises(ValueError, match=r"attention_backend='_native_math' cannot run with parallel='ring' over 2"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", workers=2, parallel="ring",
                                      attention_backend="_native_math")
    with pytest.raises(ValueError, match=r"attention_backend='_native_math' is not available for the latte family"):
        VideoPipeline.from_pretrained("tiny-latte", device="cpu", attention_backend="_native_math")
    with pytest.raises(ValueError, match=r"attention_backend='_native_math' is not available for the causal-wan"):
        VideoPipeline.from_pretrained("tiny-live", device="cpu", attention_backend="_native_math")


def test_the_cli_and_the_servers_config_refuse_it_naming_the_field(tmp_path, capsys):
    from longserve.server.cli import main

    out = tmp_path / "x.mp4"
    assert main(["generate", "x", "--model", "tiny-wan", "--device", "cpu", "--attention-backend", "flash",
                 "-o", str(out)]) == 2
    assert "attention_backend='flash' is not usable here" in capsys.readouterr().err and not out.exists()
    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny-wan\ndevice: cpu\nattention_backend: _native_cudnn\n")
    assert main(["serve", "--config", str(config), "--data-dir", str(tmp_path / "data"), "--score-model",
                 "none"]) == 2
    assert "attention_backend='_native_cudnn' does not run on cpu" in capsys.readouterr().err


def test_plans_that_merge_attention_themselves_take_only_native():
    """Ring and USP's ring merge partial attentions with a log-sum-exp; so does LTX-2's video->audio attention on
    more than one sequence-parallel worker (also when a running engine's plan changes: `VideoEngine.set_plan`)."""
    from longserve.engine.attention import check_plan
    from longserve.engine.families.ltx2.family import FAMILY as LTX2Family
    from longserve.engine.families.wan import WanFamily
    from longserve.engine.parallel import ParallelPlan

    for plan, workers in ((ParallelPlan("ulysses"), 4), (ParallelPlan("ring"), 1), (ParallelPlan("usp", False, 4), 4),
                          (ParallelPlan("ring", True), 2)):
        check_plan("flash", WanFamily, plan, workers)                     # no ring pass: the backend runs everywhere
    for plan, workers in ((ParallelPlan("ring"), 2), (ParallelPlan("usp", False, 2), 4),
                          (ParallelPlan("ring", True), 4)):
        check_plan("native", WanFamily, plan, workers)
        with pytest.raises(ValueError, match=r"attention_backend='flash' cannot run with parallel='(ring|usp)'"):
            check_plan("flash", WanFamily, plan, workers)
    check_plan("flash", LTX2Family, ParallelPlan("ulysses", True), 2)     # one worker per CFG half: nothing to merge
    with pytest.raises(ValueError, match=r"2 sequence-parallel workers \(the video->audio attention"):
        check_plan("flash", LTX2Family, ParallelPlan("ulysses"), 2)

"""Regional compile (`compile="blocks"`, engine/compile.py) and FP8 weights (`quantize="fp8"`, engine/quantize.py).

The compile tests run torch.compile without inductor's C++ code generation, which takes about half a minute a
graph on this CPU: the mechanism (where the compiled forward sits among diffusers' hooks, the graph break at the
sequence-parallel attention, dynamic batch rows, the warm-up) with the "eager" backend on workers (dynamo's graphs
run as traced; about half the compile time of "aot_eager", which the in-process block test keeps); `longserve
bench speed --compile blocks` runs inductor itself (docs/design.md, "Regional compile and FP8"). FP8 needs a GPU
with compute capability >= 8.9: on CPU only its refusal is tested."""

import numpy as np
import pytest
import torch

from longserve.engine.config import EngineConfig
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

PROMPT, NEGATIVE = "a red ball bouncing", "blurry, low quality"
WAN = dict(num_frames=5, height=32, width=48, num_inference_steps=3, guidance_scale=5.0, seed=0)
# the random tiny-wan's head residual changes by 0.67-1.3 of itself from step to step: this threshold skips some
CACHE = {"kind": "first_block", "threshold": 0.8}
TWO = [PROMPT, "a blue cube"]
WAN6 = dict(WAN, num_inference_steps=6)           # enough steps for the cache to skip some
COMPILED = dict(compile="blocks", compile_backend="eager")


def test_bad_values_and_impossible_combinations_are_refused_at_start_naming_the_option(monkeypatch):
    import longserve.engine.engine as engine_module

    def no_workers(*args, **kwargs):
        raise AssertionError("the workers were started before the options were checked")

    monkeypatch.setattr(engine_module, "make_pool", no_workers)
    with pytest.raises(ValueError, match="compile must be one of none, blocks"):
        EngineConfig(compile="model")
    with pytest.raises(ValueError, match="quantize must be one of none, fp8"):
        EngineConfig(quantize="int4")
    with pytest.raises(ValueError, match=r"quantize='fp8' is not available: this engine runs on cpu.*8\.9"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", dtype="bfloat16", quantize="fp8")
    with pytest.raises(ValueError, match=r"compile='blocks' cannot be used with --lora"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", loras={"l": "tiny-wan-lora"}, **COMPILED)
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs CUDA: this engine runs on cpu"):
        VideoPipeline.from_pretrained("tiny-live", device="cpu", cuda_graphs=True, **COMPILED)
    with pytest.raises(ValueError, match=r"compile='blocks' is not available for 'tiny-helios'"):
        VideoPipeline.from_pretrained("tiny-helios", device="cpu", **COMPILED)


def test_a_compiled_block_is_the_innermost_forward_under_the_hooks_and_one_graph_serves_every_batch_size():
    """The step-caching hooks stay eager around the compiled forward (the forward is diffusers' bit for bit with
    aot_eager); batch sizes 2, 3 and 5 share one graph, a batch of one row costs one more (torch specialises size 1)."""
    from diffusers import WanTransformer3DModel

    from longserve.engine.cache import StepCache, WanStepCache
    from longserve.engine.compile import CompiledBlock, compile_blocks, compiled_graphs

    path = resolve_model("tiny-wan") / "transformer"
    plain, compiled = (WanTransformer3DModel.from_pretrained(path) for _ in range(2))
    assert compile_blocks(compiled.blocks, "aot_eager") == 2
    WanStepCache(compiled, StepCache(blocks=len(compiled.blocks)))
    assert isinstance(compiled.blocks[0]._diffusers_hook._fn_refs[0].original_forward, CompiledBlock)
    before = compiled_graphs()
    graphs = []
    for rows in (2, 5, 1, 3):
        g = torch.Generator().manual_seed(rows)
        x, t = torch.randn(rows, 8, 3, 6, 8, generator=g), torch.rand(rows, generator=g) * 900
        text = torch.randn(rows, 7, 32, generator=g)
        with torch.no_grad():
            assert torch.equal(plain(x, t, text, return_dict=False)[0], compiled(x, t, text, return_dict=False)[0])
        graphs.append(compiled_graphs() - before)
    assert graphs == [1, 1, 2, 2], graphs                # both blocks share the graph; size 1 is its own


def test_compiled_wan_on_two_workers_equals_one_uncompiled_worker_and_stops_compiling(pipeline):
    """Ulysses over 2 workers, the graph broken at its all-to-alls; two prompts with FirstBlockCache skipping (4
    rows, then the sub-batches of the rows that recompute), twice: the second time compiles nothing."""
    cached = pipeline("tiny-wan", workers=1)(TWO, cache=CACHE, **WAN6)
    assert cached.timings["blocks_skipped"] > 0
    with VideoPipeline.from_pretrained("tiny-wan", device="cpu", workers=2, **COMPILED) as pipe:
        info = pipe.info
        assert info.compile == "blocks" and info.compile_s > 0 and info.compiled_graphs > 0   # warmed up at load
        graphs = []
        for _ in range(2):
            got = pipe(TWO, cache=CACHE, **WAN6)
            assert got.timings["blocks_skipped"] == cached.timings["blocks_skipped"]
            assert np.abs(got.frames - cached.frames).max() <= 1e-4
            graphs.append(pipe.engine.stats().compiled_graphs)
        assert graphs[1] == graphs[0], "the same batches again compiled nothing new"


def test_compiled_tiny_live_equals_eager_with_its_cached_attention_as_a_graph_break(pipeline):
    """The causal family's blocks compiled (engine/models/causal.py: the cached attention and the per-prompt text K/V
    run eager between the graphs): 5 chunks of tiny-live, the last evicting from the window and re-rotating the sink,
    equal the eager loop; the same video again compiles nothing."""
    live = dict(num_frames=15, seed=0, output_type="latent")
    want = pipeline("tiny-live", workers=1)("a red ball bouncing", **live).frames
    with VideoPipeline.from_pretrained("tiny-live", device="cpu", workers=1, **COMPILED) as pipe:
        assert pipe.info.compile == "blocks" and pipe.info.compiled_graphs > 0    # warmed up at load
        graphs = []
        for _ in range(2):
            got = pipe("a red ball bouncing", **live).frames
            assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-5
            graphs.append(pipe.engine.stats().compiled_graphs)
        assert graphs[1] == graphs[0], "the same video again compiled nothing new"


def test_compiled_latte_dsp_equals_uncompiled_with_step_caching_and_its_baselines_run_eager(pipeline):
    kw = dict(num_frames=4, num_inference_steps=4, seed=0)
    cache = {"kind": "first_block", "threshold": 0.2}
    pipe = pipeline("tiny-latte", workers=1)
    exact, cached = pipe(PROMPT, **kw), pipe([PROMPT, "a blue square"], cache=cache, **kw)
    with VideoPipeline.from_pretrained("tiny-latte", device="cpu", workers=2, **COMPILED) as pipe:
        assert np.abs(pipe(PROMPT, **kw).frames - exact.frames).max() <= 1e-4
        got = pipe([PROMPT, "a blue square"], cache=cache, **kw)
        assert got.timings["blocks_skipped"] == cached.timings["blocks_skipped"]
        assert np.abs(got.frames - cached.frames).max() <= 1e-4
        pipe.set_parallel("ulysses")      # new attention processors every call: the blocks' eager forward
        graphs = pipe.engine.stats().compiled_graphs
        assert np.abs(pipe(PROMPT, **kw).frames - exact.frames).max() <= 1e-4
        assert pipe.engine.stats().compiled_graphs == graphs


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 weights need a CUDA GPU with compute capability >= 8.9")
def test_fp8_weights_on_a_gpu_keep_the_frames_close_and_the_kept_layers_in_bf16():
    """tiny-latte (hidden size 96: FP8 matmuls take multiples of 16; tiny-wan's 36 do not)."""
    pytest.importorskip("torchao")
    from diffusers import LatteTransformer3DModel

    from longserve.engine.quantize import quantize_fp8

    model = LatteTransformer3DModel.from_pretrained(resolve_model("tiny-latte") / "transformer",
                                                    torch_dtype=torch.bfloat16).to("cuda")
    assert quantize_fp8(model) == 3 * (10 + 6)     # 3 layers of spatial (attn1, attn2: 4 each; ff: 2), temporal (6)
    block = model.transformer_blocks[0]
    assert type(block.attn1.to_q.weight) is not type(model.proj_out.weight)       # torchao's float8 weight class
    assert model.proj_out.weight.dtype == torch.bfloat16 and type(model.proj_out.weight) is torch.nn.Parameter
    kw = dict(num_frames=4, num_inference_steps=6, seed=0)
    with VideoPipeline.from_pretrained("tiny-latte", device="cuda", dtype="bfloat16") as pipe:
        want = pipe(PROMPT, **kw).frames
    with VideoPipeline.from_pretrained("tiny-latte", device="cuda", dtype="bfloat16", quantize="fp8") as pipe:
        assert pipe.info.quantize == "fp8"
        got = pipe(PROMPT, **kw).frames
    assert np.isfinite(got).all() and np.abs(got - want).mean() < 0.05

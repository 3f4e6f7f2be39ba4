"""DSP and the embedded baselines match diffusers' own LatteTransformer3DModel forward.

One pool of 4 gloo workers serves every case; sub-groups of its first 1, 2 and 3 ranks
give the smaller worker counts.
"""

import pytest
import torch
import torch.distributed as dist
from latte_models import latte_inputs, tiny_latte_transformer

from longserve.engine import comm
from longserve.engine.models.latte import STRATEGIES, parallel_forward, temporal_pos_embed
from longserve.engine.parallel import make_cfg_groups

WORKERS = (1, 2, 3, 4)
ATOL = 1e-5


def _make_subgroups(ctx):
    groups = {}
    for n in WORKERS:
        handle = dist.new_group(list(range(n)))  # every rank must call new_group
        if ctx.pg.rank < n:
            groups[n] = ctx.pg.subgroup(list(range(n)), handle)
    ctx.state["groups"] = groups
    ctx.state["cfg"] = {n: make_cfg_groups(ctx.pg, list(range(n))) for n in (2, 4)}


def _forward_everywhere(ctx, model_kwargs, inputs, strategies, worker_counts, long_video=False):
    """Run every (strategy, N) and return {(strategy, N): (output, comm stats)} on rank 0."""
    if "groups" not in ctx.state:
        _make_subgroups(ctx)
    model = tiny_latte_transformer(**model_kwargs)
    x, t, enc = inputs
    results = {}
    with torch.no_grad():
        for n in worker_counts:
            for strategy in strategies:
                pg = ctx.state["groups"].get(n)
                comm.STATS.reset()
                out = parallel_forward(model, x, t, enc, pg, strategy) if pg is not None else None
                results[(strategy, n)] = (out, comm.STATS.snapshot())
    return results if ctx.pg.rank == 0 else None


def _cfg_forward(ctx, model_kwargs, inputs, n):
    if "groups" not in ctx.state:
        _make_subgroups(ctx)
    model = tiny_latte_transformer(**model_kwargs)
    cfg = ctx.state["cfg"].get(n)
    with torch.no_grad():
        out = parallel_forward(model, *inputs, ctx.state["groups"].get(n), "dsp", cfg=cfg) if cfg else None
    return out


@pytest.fixture(scope="module")
def pool(bare_pool4):
    return bare_pool4


def reference(model_kwargs, inputs):
    model = tiny_latte_transformer(**model_kwargs)
    x, t, enc = inputs
    with torch.no_grad():
        return model(x, timestep=t, encoder_hidden_states=enc).sample


def _check_all(pool, model_kwargs, inputs):
    want = reference(model_kwargs, inputs)
    assert want.abs().mean() > 0.1, "reference output should be unit-scale"
    got = pool.run(_forward_everywhere, model_kwargs, inputs, STRATEGIES, WORKERS)[0]
    for (strategy, n), (out, _) in got.items():
        assert out.shape == want.shape, (strategy, n)
        err = (out - want).abs().max().item()
        assert err <= ATOL, f"{strategy} on {n} workers differs from diffusers by {err:.2e}"
    return got


def test_all_strategies_match_diffusers_on_odd_frames_patches_and_heads(pool):
    # T=13 frames, a 5x7 patch grid, 3 heads: none divides by 2 or 4; batch 2, two timesteps.
    model_kwargs = dict(heads=3, video_length=13)
    inputs = latte_inputs(batch=2, frames=13, grid_h=5, grid_w=7)
    assert inputs[1][0] != inputs[1][1]
    _check_all(pool, model_kwargs, inputs)


def test_all_strategies_match_diffusers_with_heads_not_divisible_by_three(pool):
    model_kwargs = dict(heads=2, head_dim=12, video_length=7, seed=3)
    inputs = latte_inputs(batch=1, frames=7, grid_h=3, grid_w=3, seed=4)
    _check_all(pool, model_kwargs, inputs)


def test_communication_per_forward_matches_each_strategy_plan(pool):
    layers = 3
    model_kwargs = dict(heads=4, layers=layers, video_length=8)
    inputs = latte_inputs(batch=2, frames=8, grid_h=4, grid_w=4)
    got = _check_all(pool, model_kwargs, inputs)
    n = 2
    calls = {s: got[(s, n)][1]["calls"] for s in STRATEGIES}
    # DSP: one switch before every temporal block, one back before every later spatial block.
    assert calls["dsp"] == {"all_to_all": 2 * layers - 1, "all_gather": 1}
    assert calls["ulysses"] == {"all_to_all": 4 * layers, "all_gather": 1}
    assert calls["ring"] == {"send_recv": (n - 1) * layers, "all_gather": 1}
    # spatial self-attn, cross-attn, MLP; temporal self-attn, MLP: gather + reduce-scatter each
    assert calls["megatron-sp"] == {"all_gather": 5 * layers + 1, "reduce_scatter": 5 * layers}
    sent = {s: got[(s, n)][1]["bytes_sent"] for s in STRATEGIES}
    assert sent["dsp"] <= 0.5 * sent["ulysses"]
    assert sent["dsp"] < min(sent["ring"], sent["megatron-sp"])
    for s in STRATEGIES:
        assert got[(s, 1)][1]["bytes_sent"] == 0


def test_dsp_runs_videos_longer_than_config_video_length(pool):
    model_kwargs = dict(heads=3, video_length=8)
    inputs = latte_inputs(batch=1, frames=11, grid_h=3, grid_w=4)
    # the reference: diffusers' own model built for 11 frames (its own 11-row position table), with the
    # 8-frame model's weights; nothing of ours computes it
    model = tiny_latte_transformer(**model_kwargs)
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    eleven = type(model)(**{**config, "video_length": 11}).eval()
    missing, unexpected = eleven.load_state_dict(model.state_dict(), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        want = eleven(inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2]).sample
    got = pool.run(_forward_everywhere, model_kwargs, inputs, ("dsp",), (3, 4))[0]
    for key, (out, _) in got.items():
        assert (out - want).abs().max().item() <= ATOL, key


@pytest.mark.parametrize("n", [2, 4])
def test_cfg_parallel_matches_diffusers(pool, n):
    model_kwargs = dict(heads=3, video_length=9)
    inputs = latte_inputs(batch=2, frames=9, grid_h=3, grid_w=5, seed=7)
    want = reference(model_kwargs, inputs)
    got = pool.run(_cfg_forward, model_kwargs, inputs, n)[0]
    assert (got - want).abs().max().item() <= ATOL


def test_temporal_pos_embed_equals_diffusers_buffer():
    model = tiny_latte_transformer(video_length=13)
    assert torch.equal(temporal_pos_embed(model, 13, torch.float32, "cpu"), model.temp_pos_embed)
    longer = temporal_pos_embed(model, 20, torch.float32, "cpu")
    assert longer.shape == (1, 20, 24)
    # the first video_length rows of a longer embedding are the same sinusoid
    assert torch.allclose(longer[:, :13], model.temp_pos_embed, atol=1e-6)


def _masked_forward(ctx, model_kwargs, inputs, mask, n):
    if "groups" not in ctx.state:
        _make_subgroups(ctx)
    model = tiny_latte_transformer(**model_kwargs)
    pg = ctx.state["groups"].get(n)
    with torch.no_grad():
        return {s: parallel_forward(model, *inputs, pg, s, encoder_attention_mask=mask) if pg else None
                for s in STRATEGIES}


def test_prompts_of_different_lengths_share_a_batch_through_the_text_mask(pool):
    """A padded, masked prompt in a batch gives what the unpadded prompt gives alone."""
    model_kwargs = dict(heads=3, video_length=5)
    x, t, enc = latte_inputs(batch=2, frames=5, grid_h=3, grid_w=3, text_len=6, seed=11)
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    padded = enc.clone()
    padded[1, 4:] = 0
    alone = [reference(model_kwargs, (x[i:i + 1], t[i:i + 1], enc[i:i + 1, : int(mask[i].sum())])) for i in range(2)]
    got = pool.run(_masked_forward, model_kwargs, (x, t, padded), mask, 2)[0]
    for strategy, out in got.items():
        for i in range(2):
            err = (out[i:i + 1] - alone[i]).abs().max().item()
            assert err <= ATOL, f"{strategy}: sample {i} differs by {err:.2e}"

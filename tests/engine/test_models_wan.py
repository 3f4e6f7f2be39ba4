"""Ulysses, Ring and USP as hooks on diffusers' own Wan and SkyReels-V2 transformers (engine/models/wan.py):
diffusers' forward, sharded, matches diffusers' forward unsharded -- bitwise on one worker, within 1e-5 on
2-4 workers (fp32).

One pool of 4 gloo workers serves every case; sub-groups of its first 1, 2, 3 and 4 ranks
give the worker counts. 3 heads, 5 latent frames and a 5x7 patch grid divide by none of them.
"""

import math

import pytest
import torch
import torch.distributed as dist

from longserve.engine import comm
from longserve.engine.models.wan import WanSequenceParallel
from longserve.engine.parallel import cfg_parallel, make_cfg_groups, make_sequence_parallel, resolve_plan
from tools.bench.models import random_wan_transformer

ATOL = 1e-5
PLANS = [("ulysses", None), ("ring", None), ("usp", 2)]


def plan_sizes(plan, k):
    """Worker counts a plan runs at in this module (USP needs its Ulysses degree to divide N)."""
    return [n for n in (1, 2, 3, 4) if plan != "usp" or n % k == 0]


def _make_groups(ctx):
    """Every rank builds every group (new_group is collective over the world); members keep theirs."""
    sps, cfgs = {}, {}
    for n in (1, 2, 3, 4):
        members = list(range(n))
        handle = dist.new_group(members)
        pg = ctx.pg.subgroup(members, handle) if ctx.pg.rank < n else None
        for plan, k in PLANS:
            if n in plan_sizes(plan, k or 1):
                sps[(plan, n)] = make_sequence_parallel(pg, plan, k, members=members)
        if n in (2, 4):
            cfg = make_cfg_groups(ctx.pg, members)
            halves = [members[:n // 2], members[n // 2:]]
            for plan, k in PLANS:
                if n // 2 in plan_sizes(plan, k or 1):
                    mine = [make_sequence_parallel(cfg.half if cfg is not None and cfg.index == i else None, plan, k,
                                                   members=h) for i, h in enumerate(halves)]
                    cfgs[(plan, n)] = (cfg, mine[cfg.index] if cfg is not None else None)
    ctx.state["sps"], ctx.state["cfgs"] = sps, cfgs


def _run(ctx, model_kwargs, inputs, cases, forward_kwargs=None, cfg=False):
    """{(plan, n): (output, comm stats)} on rank 0 for every case."""
    if "sps" not in ctx.state:
        _make_groups(ctx)
    model = WanSequenceParallel(random_wan_transformer(**model_kwargs))
    results = {}
    with torch.no_grad():
        for case in cases:
            if cfg:
                groups, sp = ctx.state["cfgs"][case]
                run = groups is not None
            else:
                sp, groups = ctx.state["sps"][case], None
                run = sp is not None
            comm.STATS.reset()
            if run and groups is not None:      # CFG-parallel around the forward, as `VideoFamily.denoise` puts it
                out = cfg_parallel(model, groups, *inputs, sp=sp, **(forward_kwargs or {}))
            else:
                out = model(*inputs, sp, **(forward_kwargs or {})) if run else None
            results[case] = (out, comm.STATS.snapshot())
    return results if ctx.pg.rank == 0 else None


@pytest.fixture(scope="module")
def pool(bare_pool4):
    return bare_pool4


def wan_inputs(batch=2, frames=5, grid_h=5, grid_w=7, text_len=6, text_dim=16, seed=1, per_frame=False,
               per_token=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, frames, 2 * grid_h, 2 * grid_w, generator=g)
    if per_frame:
        t = torch.randint(0, 1000, (batch, frames), generator=g).float()
    elif per_token:                     # Wan 2.2 TI2V's expand_timesteps: (B, S)
        t = torch.randint(0, 1000, (batch, frames * grid_h * grid_w), generator=g).float()
    else:
        t = torch.tensor([900.0, 250.0][:batch])
    text = torch.randn(batch, text_len, text_dim, generator=g)
    return x, t, text


def reference(model_kwargs, inputs, **kwargs):
    model = random_wan_transformer(**model_kwargs)
    with torch.no_grad():
        return model(*inputs, return_dict=False, **kwargs)[0]


ALL_CASES = [(plan, n) for plan, k in PLANS for n in plan_sizes(plan, k or 1)]


def test_every_plan_matches_diffusers_wan_forward_on_sizes_that_do_not_divide(pool):
    model_kwargs = dict(heads=3)
    inputs = wan_inputs()
    want = reference(model_kwargs, inputs)
    assert want.abs().mean() > 0.1, "the reference output should be unit-scale"
    got = pool.run(_run, model_kwargs, inputs, ALL_CASES)[0]
    for case, (out, stats) in got.items():
        assert out.shape == want.shape, case
        err = (out - want).abs().max().item()
        assert err <= ATOL, f"{case} differs from diffusers by {err:.2e}"
        assert (stats["bytes_sent"] == 0) == (case[1] == 1), case
        if case[1] == 1:
            assert torch.equal(out, want), f"{case}: one worker runs diffusers' forward and kernels, bit for bit"


def test_every_plan_matches_skyreels_diffusion_forcing_with_block_causal_mask_and_frame_timesteps(pool):
    # 6 latent frames in causal blocks of 2, each frame at its own timestep, the fps embedding on
    model_kwargs = dict(heads=3, skyreels=True, frames_per_block=2, inject_sample_info=True, seed=5)
    inputs = wan_inputs(batch=1, frames=6, grid_h=5, grid_w=3, per_frame=True, seed=6)
    want = reference(model_kwargs, inputs, enable_diffusion_forcing=True, fps=[1])
    got = pool.run(_run, model_kwargs, inputs, ALL_CASES, dict(fps=1, frames_per_block=2))[0]
    for case, (out, _) in got.items():
        err = (out - want).abs().max().item()
        assert err <= ATOL, f"{case} differs from diffusers by {err:.2e}"
    # the mask matters: without it the output differs
    unmasked = pool.run(_run, model_kwargs, inputs, [("ulysses", 2)], dict(fps=1, frames_per_block=1))[0]
    assert (unmasked[("ulysses", 2)][0] - want).abs().max().item() > 1e-2


def _time_embedding_rows(ctx, model_kwargs, inputs):
    """The tokens whose modulation each rank builds, on a 4-way sharded forward with per-token timesteps."""
    if "sps" not in ctx.state:
        _make_groups(ctx)
    seen = []
    model = random_wan_transformer(**model_kwargs)
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[2].shape[1]))
    with torch.no_grad():
        WanSequenceParallel(model)(*inputs, ctx.state["sps"][("ring", 4)])
    return seen[0]


def test_every_plan_matches_wan22_per_token_timesteps_each_rank_embedding_its_own_tokens(pool):
    """Wan 2.2 TI2V gives the transformer a timestep per token, (B, S): diffusers builds the modulation
    (B, S, 6, D); sharded, each rank gets its own tokens' timesteps and builds (B, Sl, 6, D)."""
    model_kwargs = dict(heads=3, seed=10)
    inputs = wan_inputs(per_token=True, seed=11)                           # S = 5 * 5 * 7 = 175, random t
    want = reference(model_kwargs, inputs)
    got = pool.run(_run, model_kwargs, inputs, ALL_CASES)[0]
    for case, (out, _) in got.items():
        err = (out - want).abs().max().item()
        assert err <= ATOL, f"{case} differs from diffusers by {err:.2e}"
    assert pool.run(_time_embedding_rows, model_kwargs, inputs) == [math.ceil(175 / 4)] * 4


@pytest.mark.parametrize("n", [2, 4])
def test_cfg_parallel_composes_with_every_plan(pool, n):
    model_kwargs = dict(heads=3, seed=2)
    inputs = wan_inputs(seed=3)            # batch 2: the "unconditional" and "conditional" halves
    want = reference(model_kwargs, inputs)
    cases = [(plan, n) for plan, k in PLANS if n // 2 in plan_sizes(plan, k or 1)]
    got = pool.run(_run, model_kwargs, inputs, cases, None, True)[0]
    assert len(got) >= 2
    for case, (out, _) in got.items():
        assert (out - want).abs().max().item() <= ATOL, case


def test_collectives_and_bytes_per_forward_match_each_plan_formula(pool):
    layers, heads, head_dim, B, frames, gh, gw = 2, 3, 12, 2, 5, 5, 7
    model_kwargs = dict(heads=heads, head_dim=head_dim, layers=layers)
    inputs = wan_inputs(batch=B, frames=frames, grid_h=gh, grid_w=gw)
    got = pool.run(_run, model_kwargs, inputs, ALL_CASES)[0]
    S, e, out_per_token = frames * gh * gw, 4, 2 * 2 * 4      # tokens, fp32 bytes, p_h*p_w*C_out
    for (plan, n), (_, stats) in got.items():
        if n == 1:
            continue
        Sl = math.ceil(S / n)
        gather = (n - 1) * B * Sl * out_per_token * e
        if plan == "ulysses":
            Hp = math.ceil(heads / n) * n
            calls = {"all_to_all": 2 * layers, "all_gather": 1}
            sent = layers * 4 * B * Sl * Hp * head_dim * e * (n - 1) / n + gather
        elif plan == "ring":
            calls = {"send_recv": (n - 1) * layers, "all_gather": 1}
            sent = layers * (n - 1) * 2 * B * heads * Sl * head_dim * e + gather
        else:
            k, r = 2, n // 2
            Hl = math.ceil(heads / k)
            calls = {"all_to_all": 2 * layers, "all_gather": 1}
            if r > 1:
                calls["send_recv"] = (r - 1) * layers
            sent = (layers * 4 * B * Sl * Hl * k * head_dim * e * (k - 1) / k
                    + layers * (r - 1) * 2 * B * Hl * k * Sl * head_dim * e + gather)
        assert stats["calls"] == calls, (plan, n, stats["calls"])
        assert abs(stats["bytes_sent"] - sent) <= 8 * layers, (plan, n, stats["bytes_sent"], sent)


def test_auto_plan_picks_ulysses_usp_or_ring_from_heads_and_workers():
    assert resolve_plan("auto", ("ulysses", "ring", "usp"), 2, 3, "sequence").name == "ulysses"
    assert resolve_plan("auto", ("ulysses", "ring", "usp"), 4, 3, "sequence") == \
        resolve_plan("usp", ("ulysses", "ring", "usp"), 4, 3, "sequence", ulysses_degree=2)
    assert resolve_plan("auto", ("ulysses", "ring", "usp"), 4, 1, "sequence").name == "ring"
    assert resolve_plan("auto", ("ulysses", "ring", "usp"), 8, 3, "sequence", cfg_parallel=True).name == "usp"
    assert resolve_plan("auto", ("dsp", "ulysses"), 4, 3, "dsp").name == "dsp"
    with pytest.raises(ValueError, match="ulysses, ring, usp"):
        resolve_plan("dsp", ("ulysses", "ring", "usp"), 2, 3, "sequence")
    with pytest.raises(ValueError, match="ulysses_degree"):
        resolve_plan("usp", ("ulysses", "ring", "usp"), 4, 3, "sequence", ulysses_degree=3)
    with pytest.raises(ValueError, match="even"):
        resolve_plan("ulysses", ("ulysses", "ring", "usp"), 3, 3, "sequence", cfg_parallel=True)


def test_a_batch_of_diffusion_forcing_rows_gives_each_row_what_it_gets_alone(pool):
    """Rows at different per-frame timesteps share one forward (one fps for the batch, as the engine batches)."""
    model_kwargs = dict(heads=3, skyreels=True, frames_per_block=2, inject_sample_info=True, seed=8)
    inputs = wan_inputs(batch=2, frames=4, grid_h=3, grid_w=3, per_frame=True, seed=9)
    alone = [reference(model_kwargs, [t[i:i + 1] for t in inputs], enable_diffusion_forcing=True, fps=[0])
             for i in range(2)]
    got = pool.run(_run, model_kwargs, inputs, [("ring", 2), ("usp", 4)], dict(fps=0, frames_per_block=2))[0]
    for case, (out, _) in got.items():
        for i in range(2):
            assert (out[i:i + 1] - alone[i]).abs().max().item() <= ATOL, (case, i)


def test_outside_a_sharded_call_the_hooked_model_is_diffusers_model_unchanged():
    from longserve.engine.dist import ParallelGroup
    from longserve.engine.parallel import make_sequence_parallel

    inputs = wan_inputs(seed=4)
    want = reference(dict(heads=3), inputs)
    model = random_wan_transformer(heads=3)
    hooked = WanSequenceParallel(model)
    solo = make_sequence_parallel(ParallelGroup(rank=0, world_size=1, device=torch.device("cpu")), "ring")
    with torch.no_grad():
        assert torch.equal(hooked(*inputs, solo), want)
        assert torch.equal(model(*inputs, return_dict=False)[0], want), "the hooks pass through when idle"


def _modulation_rows(ctx, model_kwargs, inputs):
    """The per-token modulation's token count each block receives, on a 4-way sharded diffusion-forcing forward."""
    if "sps" not in ctx.state:
        _make_groups(ctx)
    seen = []
    model = random_wan_transformer(**model_kwargs)
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[2].shape[2]))
    with torch.no_grad():
        WanSequenceParallel(model)(*inputs, ctx.state["sps"][("ulysses", 4)], fps=1, frames_per_block=2)
    return seen[0]


def test_diffusion_forcing_modulation_is_built_for_each_rank_s_frames_only(pool):
    """diffusers repeats per-frame modulation over every token; sharded, each rank builds it for its own
    frames (at most its tokens plus one partial frame at each end), not for all S tokens."""
    model_kwargs = dict(heads=3, skyreels=True, frames_per_block=2, inject_sample_info=True, seed=5)
    inputs = wan_inputs(batch=1, frames=8, grid_h=3, grid_w=5, per_frame=True, seed=6)     # S = 8 * 15 = 120
    rows = pool.run(_modulation_rows, model_kwargs, inputs)
    S, frame_tokens, Sl = 8 * 15, 15, 30
    assert all(r <= Sl + 2 * frame_tokens and r < S for r in rows), rows


# -- through the Wan family's sharded self-attention (engine/models/wan.py, engine/parallel.py) ------------------


class _Masked:
    """diffusers' own Wan self-attention processor, handed a dense radial mask: the reference."""

    def __init__(self, inner, mask):
        self.inner, self.mask = inner, mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def test_radial_wan_forward_on_every_plan_equals_diffusers_with_the_dense_mask(bare_pool4):
    """Ulysses, Ring and USP at 1-4 workers (3 heads, 5 latent frames, a 5x7 patch grid: uneven everywhere) with
    `radial=True` equal diffusers' forward whose self-attention gets the dense mask (ATOL 1e-5), and differ from the
    dense forward: the mask is applied, by global positions, on every shard."""
    from longserve.engine.attention import RadialMask

    inputs = wan_inputs()
    model = random_wan_transformer(heads=3)
    mask = RadialMask(5, 35, dense_frames=1).dense()           # 5 latent frames of 5 x 7 patches
    for block in model.blocks:
        block.attn1.set_processor(_Masked(block.attn1.processor, mask))
    with torch.no_grad():
        want = model(*inputs, return_dict=False)[0]
    dense = reference(dict(heads=3), inputs)
    assert (want - dense).abs().max() > 1e-3, "the radial mask should change the output"
    got = bare_pool4.run(_run, dict(heads=3), inputs, ALL_CASES, {"radial": True})[0]
    for case, (out, _) in got.items():
        err = (out - want).abs().max().item()
        assert err <= ATOL, f"{case}: radial differs from the dense-masked reference by {err:.2e}"

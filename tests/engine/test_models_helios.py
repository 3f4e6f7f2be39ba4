"""Ulysses, Ring and USP as hooks on diffusers' own Helios transformer (engine/models/helios.py): diffusers'
forward over [long | mid | short history | chunk] tokens, sharded, matches diffusers' forward unsharded within
1e-5 on 2-4 workers (fp32), the history keys amplified by global position on every rank.

One pool of 4 gloo workers serves every case; sub-groups of its first 1-4 ranks give the worker counts. 3 heads
and a sequence of 89 tokens (a 3x5 patch grid) divide by none of 2, 3 and 4.
"""

import pytest
import torch
import torch.distributed as dist

from longserve.engine import comm
from longserve.engine.families.helios import history_indices
from longserve.engine.models.helios import HeliosSequenceParallel
from longserve.engine.parallel import make_sequence_parallel
from tools.weights.build_tiny_helios import build_helios_transformer

ATOL = 1e-5
CASES = [("ulysses", None, n) for n in (1, 2, 3, 4)] + [("ring", None, n) for n in (2, 3, 4)] + [("usp", 2, 4)]


def _groups(ctx):
    if "helios_sps" not in ctx.state:
        sps = {}
        for n in (1, 2, 3, 4):
            members = list(range(n))
            handle = dist.new_group(members)
            pg = ctx.pg.subgroup(members, handle) if ctx.pg.rank < n else None
            for plan, k, m in CASES:
                if m == n:
                    sps[(plan, n)] = make_sequence_parallel(pg, plan, k, members=members)
        ctx.state["helios_sps"] = sps
    return ctx.state["helios_sps"]


def _run(ctx, inputs, amplify):
    """{(plan, n): (output, bytes sent, tokens block 0 saw)} on rank 0."""
    sps = _groups(ctx)
    model = build_helios_transformer(is_amplify_history=amplify)
    with torch.no_grad():                    # a visible history scale, not the init's sigmoid(1) everywhere
        for block in model.blocks:
            if amplify:
                block.attn1.history_key_scale.copy_(torch.tensor([2.0, -1.0, 0.5]))
    seen = []
    model.blocks[0].attn1.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    sp_model = HeliosSequenceParallel(model)
    results = {}
    with torch.no_grad():
        for plan, _, n in CASES:
            sp = sps[(plan, n)]
            comm.STATS.reset()
            seen.clear()
            out = sp_model(*inputs, sp) if sp is not None else None
            results[(plan, n)] = (out, comm.STATS.snapshot()["bytes_sent"], seen[-1] if seen else None)
    return results if ctx.pg.rank == 0 else None


def helios_inputs(batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, 3, 6, 10, generator=g)                     # a chunk of 3 latent frames, 3x5 patches
    t = torch.tensor([900.0, 250.0][:batch])
    text = torch.randn(batch, 7, 32, generator=g)
    history = {"latents_history_long": torch.randn(batch, 8, 16, 6, 10, generator=g),
               "latents_history_mid": torch.randn(batch, 8, 2, 6, 10, generator=g),
               "latents_history_short": torch.randn(batch, 8, 2, 6, 10, generator=g),
               **history_indices([16, 2, 1], 3)}
    return x, t, text, history


@pytest.mark.parametrize("amplify", [True, False], ids=["amplified history", "plain history"])
def test_every_plan_matches_diffusers_helios_forward_over_history_and_chunk(bare_pool4, amplify):
    inputs = helios_inputs()
    x, t, text, history = inputs
    with torch.no_grad():
        want = build_helios_transformer(is_amplify_history=amplify)
        if amplify:
            for block in want.blocks:
                block.attn1.history_key_scale.copy_(torch.tensor([2.0, -1.0, 0.5]))
        want = want(x, t, text, return_dict=False, **history)[0]
    assert want.shape == x.shape and want.abs().mean() > 0.1
    assert HeliosSequenceParallel(build_helios_transformer()).tokens(x, history) == (89, 45)
    got = bare_pool4.run(_run, inputs, amplify)[0]
    for (plan, n), (out, sent, tokens) in got.items():
        err = (out - want).abs().max().item()
        assert err <= ATOL, f"{plan} on {n} differs from diffusers by {err:.2e}"
        assert (sent == 0) == (n == 1), (plan, n)
        assert tokens == (89 if n == 1 else -(-89 // n)), (plan, n, tokens)        # attn1 saw my tokens only

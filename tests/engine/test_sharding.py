"""The shard-plan engine itself (engine/sharding.py), on a tiny module tree of diffusers' shape (blocks of a
processor-driven self-attention with a per-token table, an output head): a plan that splits 7 tokens
unevenly, travels the table with them, tells each block how many of its tokens are the chunk and
gathers the output equals the unsharded forward -- bitwise on one
worker, within 1e-5 on 2 and 3 (fp32); and the plan is checked against its geometry when it is applied."""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longserve.engine.parallel import make_sequence_parallel
from longserve.engine.sharding import (
    At,
    Gather,
    Replace,
    ShardedAttention,
    ShardedModel,
    ShardPlan,
    Split,
    TokenShard,
    current_shard,
    from_cp_plan,
)

S, HEADS = 7, 3             # divisible by none of 2, 3


class SDPA:
    """The tree's own attention processor (diffusers' kind: `processor(attn, hidden_states, ...)`)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = (p(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                   for p in (attn.to_q, attn.to_k, attn.to_v))                      # (B, H, S, hd)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3)  # (B, S, H*hd)
        return attn.to_out[1](attn.to_out[0](out))


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.heads = HEADS
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q = self.norm_k = nn.Identity()
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Identity()])
        self.processor = SDPA()

    def set_processor(self, processor):
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attn, self.ff = Attention(dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, table, current):   # table (B, S, D) per token; the last `current` get the FFN
        x = hidden_states + self.attn(hidden_states + table)
        before, chunk = x.split([x.shape[1] - current, current], dim=1)
        return torch.cat([before, chunk + self.ff(chunk)], dim=1)


class Tree(nn.Module):
    def __init__(self, dim: int = 12):
        super().__init__()
        self.embed, self.out = nn.Linear(4, dim), nn.Linear(dim, 4)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))

    def forward(self, x, table, current):               # x (B, S, 4), table (B, S, D)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, table, current)
        return self.out(h)


@dataclass(frozen=True)
class ChunkShard(TokenShard):
    """Helios' layout: the last `current` of the S tokens are the chunk."""

    current: int

    @property
    def local_current(self) -> int:
        """My tokens the blocks treat as current: my chunk tokens and the padding after them."""
        return self.Sl - max(0, min(self.stop, self.S - self.current) - self.start)


PLAN = ShardPlan(ChunkShard, {
    "blocks.0": At(inputs={"hidden_states": Split(1)}),
    "blocks.*": At(inputs={"table": Split(1, expected_dims=3), "current": Replace("local_current")}),
    "out": At(outputs={0: Gather(1)}),
}, attention={"blocks.*.attn": ShardedAttention})


def tree_and_inputs():
    torch.manual_seed(0)
    tree = Tree()
    g = torch.Generator().manual_seed(1)
    return tree, (torch.randn(2, S, 4, generator=g), torch.randn(2, S, 12, generator=g), 4)


def _sharded_forwards(ctx):
    """{(plan, n): output} on rank 0, and each rank's real-token count as step caching reads it."""
    tree, inputs = tree_and_inputs()
    sharded = ShardedModel(tree, PLAN)
    seen = []
    tree.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(current_shard(tree).real_tokens))
    results = {}
    for n in (1, 2, 3):
        members = list(range(n))
        handle = dist.new_group(members)
        pg = ctx.pg.subgroup(members, handle) if ctx.pg.rank < n else None
        for name in ("ulysses", "ring"):
            sp = make_sequence_parallel(pg, name, members=members)
            if sp is not None:
                with torch.no_grad():
                    results[(name, n)] = sharded(ChunkShard(sp, S, *ChunkShard.token_range(S, sp), 4), *inputs)
    return results if ctx.pg.rank == 0 else seen[-2:]


def test_a_plan_with_an_uneven_split_and_a_gather_equals_the_unsharded_forward(bare_pool4):
    tree, inputs = tree_and_inputs()
    with torch.no_grad():
        want = tree(*inputs)
    got, *others = bare_pool4.run(_sharded_forwards)
    for (name, n), out in got.items():
        assert out.shape == want.shape, (name, n)
        if n == 1:
            assert torch.equal(out, want), f"{name}: one worker runs the tree's own arithmetic, bit for bit"
        assert (out - want).abs().max().item() <= 1e-5, (name, n)
    assert others[0] == [3, 3] and others[1] == [1, 1], "rank 2 of 3 holds 1 real token of its 3"
    with torch.no_grad():
        ShardedModel(tree, PLAN)
        assert torch.equal(tree(*inputs), want), "outside a sharded call the hooks and processors pass through"


def test_a_plan_naming_what_its_geometry_cannot_cut_is_refused_when_applied():
    tree, _ = tree_and_inputs()
    with pytest.raises(ValueError, match="no unit 'frames'"):
        ShardedModel(tree, ShardPlan(TokenShard, {"blocks.0": At(inputs={"hidden_states": Split(1, "frames")})}))
    with pytest.raises(ValueError, match="no argument 'temb'"):
        ShardedModel(tree, ShardPlan(TokenShard, {"blocks.*": At(inputs={"temb": Split(1)})}))
    with pytest.raises(ValueError, match="no attribute 'local_current'"):
        ShardedModel(tree, ShardPlan(TokenShard, {"blocks.*": At(inputs={"current": Replace("local_current")})}))


def test_removing_a_plan_gives_back_the_model_and_its_processors():
    tree, inputs = tree_and_inputs()
    originals = [b.attn.processor for b in tree.blocks]
    ShardedModel(tree, PLAN).remove()
    assert [b.attn.processor for b in tree.blocks] == originals
    assert not any(getattr(m, "_diffusers_hook", None) and m._diffusers_hook.hooks for m in tree.modules())


def test_diffusers_wan_cp_plan_reads_as_token_splits_and_a_gather():
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    plan = from_cp_plan(WanTransformer3DModel._cp_plan)
    assert plan["rope"].outputs == {0: Split(1, "tokens", 4), 1: Split(1, "tokens", 4)}
    assert plan["blocks.0"].inputs == {"hidden_states": Split(1, "tokens", 3)}
    assert plan[""].inputs == {"timestep": Split(1, "tokens", 2)}
    assert plan["proj_out"].outputs == {0: Gather(1, 3)}

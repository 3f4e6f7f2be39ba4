"""Shard plans as data, and the one hook engine that applies them to a diffusers model.

A plan says, in the style of diffusers' `_cp_plan`, where one forward's token sequence is cut across the
workers of a sequence-parallel group and where it is joined again; diffusers' own `forward` then runs
unchanged between those points. It is keyed by module name (`""` the model itself, one `*` over a
`ModuleList`, as diffusers' plans are):

    ShardPlan(geometry=WanShard, modules={
        "rope":            At(outputs={0: Split(1), 1: Split(1)}),           # cos/sin rows of my tokens
        "patch_embedding": At(inputs={"hidden_states": Split(2, "latent_frames")}),
        "blocks.0":        At(inputs={"hidden_states": Split(1, "tokens_of_my_frames")}),
        "proj_out":        At(outputs={0: Gather(1)}),
    }, attention={"blocks.*.attn1": WanAttention})

The rules, each on one input (by name or position) or one output (by position; 0 for a lone tensor):

    Split(dim, unit)   keep this rank's share of `dim`; the *geometry* names the units it can cut
                       ("tokens": my tokens of all S, zero-padded to Sl = ceil(S/N); Wan adds "frames",
                       "latent_frames" and "tokens_of_my_frames", a tensor holding only my frames' tokens)
    Place(dim, unit)   the inverse: my tokens placed in a zero buffer as long as `unit`
    Gather(dim)        all-gather the tokens of the group, padding trimmed: (.., Sl, ..) -> (.., S, ..)
    Replace(value)     the argument becomes the geometry's `value` (Helios' `original_context_length`)

Every rule may carry `expected_dims` (applied only to a tensor of that rank, as diffusers' plans say) and
`when`, a named condition the geometry resolves for the forward (e.g. "frame_timesteps": diffusion forcing's
per-frame modulation); a rule that does not apply passes its value through. `attention` names the processor
class installed on each matching attention module: `cls(owner, layer, original)`, `layer` the index the `*`
matched. What travels with the tokens and is not an argument (a block-causal mask, KV caches) lives on the
geometry, which the processors read.

The engine's rules (longserve's, where diffusers' context parallelism differs):
- A *geometry* (a `TokenShard`) is built per forward by the model's entry point and says everything about
  this rank's shard: tokens [start, stop) of S, padded to Sl; uneven splits are padded, never refused.
- Positions are global: a split cuts tables built for the whole sequence (RoPE rows, per-token timesteps).
- The hooks are diffusers' own `ModelHook`s and do nothing outside `ShardedModel.__call__`: the model stays a
  plain diffusers model otherwise, and its processors fall back to the originals.
- A split of the same tensor by the same rule happens once per forward (every block gets the same modulation).
- `current_shard(model)` gives step caching (`engine/cache.py`) the running forward's geometry, whose
  `real_tokens` excludes the padding from its metrics.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field, fields

import torch
from diffusers.hooks import HookRegistry, ModelHook

from longserve.engine import comm
from longserve.engine.parallel import SequenceParallel, sequence_parallel_attention

HOOK = "longserve_shard---{}"


# -- the vocabulary ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """Keep this rank's share of `dim`, in the geometry's `unit`."""

    dim: int
    unit: str = "tokens"
    expected_dims: int | None = None
    when: str | None = None


@dataclass(frozen=True)
class Place:
    """Put my tokens (dim `dim`) in a zero buffer as long as the geometry's `unit` (the inverse of a Split)."""

    dim: int
    unit: str
    expected_dims: int | None = None
    when: str | None = None


@dataclass(frozen=True)
class Gather:
    """All-gather the group's tokens along `dim` and trim the padding."""

    dim: int
    expected_dims: int | None = None
    when: str | None = None


@dataclass(frozen=True)
class Replace:
    """The argument becomes the geometry's attribute `value`."""

    value: str
    expected_dims: None = None
    when: str | None = None


Rule = Split | Place | Gather | Replace


@dataclass(frozen=True)
class At:
    """The rules at one module: on inputs (keyed by argument name or position) and outputs (by position)."""

    inputs: dict[str | int, Rule] = field(default_factory=dict)
    outputs: dict[int, Rule] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardPlan:
    """Where a model's tokens are cut and joined (`modules`), which attention runs over the sharded sequence
    (`attention`: module name -> processor class) and the geometry class that resolves units and conditions."""

    geometry: type
    modules: dict[str, At]
    attention: dict[str, type] = field(default_factory=dict)

    def extended(self, geometry: type | None = None, modules: dict | None = None,
                 attention: dict | None = None) -> "ShardPlan":
        """This plan with entries added or replaced (and another geometry, if given)."""
        return ShardPlan(geometry or self.geometry, {**self.modules, **(modules or {})},
                         {**self.attention, **(attention or {})})


def from_cp_plan(cp_plan: dict) -> dict[str, At]:
    """diffusers' `_cp_plan` in this vocabulary: `ContextParallelInput(d, e)` -> `Split(d, "tokens", e)` on the
    input (on the output when `split_output`), `ContextParallelOutput(d, e)` -> `Gather(d, e)`. diffusers splits
    every such tensor evenly into N; here "tokens" are the geometry's share of the one sequence of S tokens."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    modules: dict[str, At] = {}
    for name, entry in cp_plan.items():
        if isinstance(entry, dict):
            inputs, outputs = {}, {}
            for key, cpi in entry.items():
                if not isinstance(cpi, ContextParallelInput):
                    raise ValueError(f"_cp_plan[{name!r}][{key!r}]: expected a ContextParallelInput, got {cpi!r}")
                (outputs if cpi.split_output else inputs)[key] = Split(cpi.split_dim, "tokens", cpi.expected_dims)
            modules[name] = At(inputs, outputs)
        else:
            entries = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
            modules[name] = At(outputs={i: Gather(c.gather_dim, c.expected_dims) for i, c in enumerate(entries)
                                        if c is not None})
    return modules


# -- the geometry of one forward --------------------------------------------------------------------


@dataclass(frozen=True)
class TokenShard:
    """One forward's shard on this rank: tokens [start, stop) of S, zero-padded to Sl = ceil(S/N).

    Models subclass it to add their units (`UNITS`, `split`, `place`) and what travels with the tokens."""

    sp: SequenceParallel
    S: int
    Sl: int
    start: int
    stop: int

    UNITS = ("tokens",)
    causal = None               # a block-causal mask (engine.parallel.BlockCausal), for models that have one

    @staticmethod
    def token_range(S: int, sp: SequenceParallel) -> tuple[int, int, int]:
        """(Sl, start, stop) of this rank: the last ranks' shards are short or empty, padded to Sl."""
        Sl = comm.shard_size(S, sp.world_size)
        return Sl, min(S, sp.pg.rank * Sl), min(S, (sp.pg.rank + 1) * Sl)

    @property
    def real_tokens(self) -> int:
        """My tokens that are not padding."""
        return self.stop - self.start

    def mine(self, x: torch.Tensor, dim: int, offset: int = 0) -> torch.Tensor:
        """My tokens of a tensor whose `dim` holds tokens [offset, ...), zero-padded to Sl."""
        return comm.pad_dim(x.narrow(dim, self.start - offset, self.stop - self.start), dim, self.Sl)

    def split(self, x: torch.Tensor, dim: int, unit: str) -> torch.Tensor:
        if unit == "tokens":
            return self.mine(x, dim)
        raise ValueError(f"{type(self).__name__} cannot split {unit!r}")

    def place(self, x: torch.Tensor, dim: int, unit: str) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} cannot place tokens in {unit!r}")

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return comm.gather(x, dim, self.S, self.sp.pg)                          # (.., Sl, ..) -> (.., S, ..)


# -- the engine -------------------------------------------------------------------------------------


#: model -> a weak reference to its ShardedModel (both weak: a dropped model and its hooks are collected)
_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sharded(model: torch.nn.Module) -> "ShardedModel | None":
    ref = _SHARDED.get(model)
    return None if ref is None else ref()


def sharded_of(model: torch.nn.Module) -> "ShardedModel | None":
    """The plan applied to `model` (its `ShardedModel`), if any."""
    return _sharded(model)


def current_shard(model: torch.nn.Module) -> TokenShard | None:
    """The geometry of the sharded forward running on `model` now; None outside one (or if never sharded)."""
    sharded = _sharded(model)
    return None if sharded is None else sharded.shard


def modules_matching(model: torch.nn.Module, name: str) -> list[tuple[int | None, torch.nn.Module]]:
    """(index the `*` matched or None, module) for a plan key: "" the model, "blocks.0", "blocks.*.attn1"."""
    if name.count("*") > 1:
        raise ValueError(f"a plan key may hold one '*': {name!r}")
    if name == "":
        return [(None, model)]
    head, star, tail = name.partition("*")
    if not star:
        return [(None, model.get_submodule(name))]
    parent = model.get_submodule(head.rstrip(".")) if head.rstrip(".") else model
    if not isinstance(parent, torch.nn.ModuleList):
        raise ValueError(f"'*' in {name!r} must stand for the entries of a ModuleList")
    tail = tail.lstrip(".")
    return [(i, m.get_submodule(tail) if tail else m) for i, m in enumerate(parent)]


def _check(plan: ShardPlan, name: str, rule: Rule) -> None:
    """A plan's rule names only units, conditions and values its geometry has (refused at load, not mid-run)."""
    attrs = {f.name for f in fields(plan.geometry)} | set(dir(plan.geometry))
    if isinstance(rule, (Split, Place)) and rule.unit not in plan.geometry.UNITS:
        raise ValueError(f"plan entry {name!r}: {plan.geometry.__name__} has no unit {rule.unit!r} "
                         f"(it has {', '.join(plan.geometry.UNITS)})")
    for attr in (rule.when, rule.value if isinstance(rule, Replace) else None):
        if attr is not None and attr not in attrs:
            raise ValueError(f"plan entry {name!r}: {plan.geometry.__name__} has no attribute {attr!r}")


class _PlanHook(ModelHook):
    """One plan entry on one module: its rules, applied while the owner runs a sharded forward."""

    def __init__(self, owner: "ShardedModel", at: At, module: torch.nn.Module, name: str):
        super().__init__()
        self.owner, self.at = owner, at
        params = list(inspect.signature(type(module).forward).parameters)[1:]      # without self
        self.positions = {}
        for key in at.inputs:
            if isinstance(key, str):
                if key not in params:
                    raise ValueError(f"plan entry {name!r}: {type(module).__name__}.forward has no argument {key!r}")
                self.positions[key] = params.index(key)

    def pre_forward(self, module, *args, **kwargs):
        if self.owner.shard is None or not self.at.inputs:
            return args, kwargs
        args = list(args)
        for key, rule in self.at.inputs.items():
            if key in kwargs:
                kwargs[key] = self.owner.apply(rule, kwargs[key])
            else:
                i = self.positions.get(key, key)
                if i < len(args):
                    args[i] = self.owner.apply(rule, args[i])
        return tuple(args), kwargs

    def post_forward(self, module, output):
        if self.owner.shard is None or not self.at.outputs:
            return output
        if torch.is_tensor(output):
            return self.owner.apply(self.at.outputs[0], output)
        out = list(output)
        for i, rule in self.at.outputs.items():
            out[i] = self.owner.apply(rule, out[i])
        return type(output)(out)


class ShardedModel:
    """`plan` applied to `model`: hooks on its modules, processors on its attention.

        sharded = ShardedModel(model, plan)             # once (or `shard_model`)
        out = sharded(geometry, *args, **kwargs)        # diffusers' forward, sharded as `geometry` says

    A model carries one plan: sharding it again removes the previous plan first (`remove`)."""

    def __init__(self, model: torch.nn.Module, plan: ShardPlan):
        if _sharded(model) is not None:
            _sharded(model).remove()
        self.model, self.plan = model, plan
        self.shard: TokenShard | None = None
        self._memo: dict = {}
        self._hooked: list[tuple[torch.nn.Module, str]] = []
        self._processors: list[tuple[torch.nn.Module, object]] = []
        for name, at in plan.modules.items():
            for rule in (*at.inputs.values(), *at.outputs.values()):
                _check(plan, name, rule)
            for _, module in modules_matching(model, name):
                registry = HookRegistry.check_if_exists_or_initialize(module)
                registry.register_hook(_PlanHook(self, at, module, name), HOOK.format(name))
                self._hooked.append((module, HOOK.format(name)))
        for name, processor in plan.attention.items():
            for layer, module in modules_matching(model, name):
                self._processors.append((module, module.processor))
                module.set_processor(processor(self, layer, module.processor))
        _SHARDED[model] = weakref.ref(self)

    def remove(self) -> None:
        """Take this plan's hooks and processors off the model: it is diffusers' model as it was."""
        for module, name in reversed(self._hooked):
            HookRegistry.check_if_exists_or_initialize(module).remove_hook(name, recurse=False)
        for module, original in reversed(self._processors):
            module.set_processor(original)
        self._hooked, self._processors = [], []
        if _sharded(self.model) is self:
            del _SHARDED[self.model]

    def rehook(self) -> None:
        """Hook the plan's modules again, found by name: after a module of the plan was replaced in its parent (a
        LoRA adapter loaded while serving wraps a linear layer: the plan's hooks belong on the wrapper, as on one
        made before the plan was applied)."""
        plan = self.plan
        self.remove()
        self.__init__(self.model, plan)

    def __call__(self, shard: TokenShard, *args, **kwargs):
        with self.running(shard):
            return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def running(self, shard: TokenShard):
        """`shard` is the running forward's geometry meanwhile: for a caller that drives the model's modules itself
        (a forward cut into pipeline stages, engine/live_stages.py)."""
        self.shard = shard
        try:
            yield self
        finally:
            self.shard = None
            self._memo.clear()

    def apply(self, rule: Rule, x):
        """`rule` on one value of the running forward; a rule that does not apply passes it through."""
        shard = self.shard
        if rule.when is not None and not getattr(shard, rule.when):
            return x
        if isinstance(rule, Replace):
            return getattr(shard, rule.value)
        if x is None or (rule.expected_dims is not None and x.ndim != rule.expected_dims):
            return x
        if not torch.is_tensor(x):
            raise TypeError(f"a {type(rule).__name__} rule applies to tensors; got {type(x).__name__}")
        if isinstance(rule, Gather):
            return shard.gather(x, rule.dim)
        key = (rule, id(x))                     # the same tensor comes to every block: cut it once
        hit = self._memo.get(key)
        if hit is None or hit[0] is not x:
            cut = shard.split if isinstance(rule, Split) else shard.place
            hit = self._memo[key] = (x, cut(x, rule.dim, rule.unit))
        return hit[1]


def shard_model(model: torch.nn.Module, plan: ShardPlan) -> ShardedModel:
    """The entry point: register `plan` on `model` (after quantize, compile and step-cache hooks)."""
    return ShardedModel(model, plan)


# -- attention over the sharded sequence ------------------------------------------------------------


def project_qkv(attn, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A diffusers Wan-style self-attention's q, k, v of my tokens: its projections (fused or not) and q/k norms.
    hidden_states (B, Sl, D) -> (B, Sl, H, hd) each."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)    # (B, Sl, H*hd)
    q, k = attn.norm_q(q), attn.norm_k(k)
    return tuple(t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))


@torch.compiler.disable
def exchanged_attention(owner: ShardedModel, q, k, v) -> torch.Tensor:
    """`sequence_parallel_attention` over the owner's current shard. Inside a compiled block (`compile` blocks) it
    runs eager: its all-to-alls and ring passes are gloo / NCCL calls on our own process groups, which dynamo would
    break the graph on anyway. The break is here by design: the projections before it and the output projection
    after it stay in the graph, and the shard (a new object every forward) is read here, never guarded on."""
    shard = owner.shard
    return sequence_parallel_attention(q, k, v, shard.sp, shard.S, causal=shard.causal)         # (B, Sl, H, hd)


class ShardedAttention:
    """A self-attention over the sharded sequence: diffusers' projections, q/k norms and rotary on my tokens, then
    Ulysses / Ring / USP attention; diffusers' own processor when no forward is sharded. Models override `rotate`
    (their rotary) and `keys` (what they do to keys before attention)."""

    def __init__(self, owner: ShardedModel, layer: int | None, original):
        self.owner, self.layer, self.original = owner, layer, original

    def rotate(self, x: torch.Tensor, rotary_emb) -> torch.Tensor:
        raise NotImplementedError

    def keys(self, attn, shard: TokenShard, k: torch.Tensor) -> torch.Tensor:
        return k

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 *args, **kwargs):
        shard = self.owner.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                                 *args, **kwargs)
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("a sequence-parallel processor is for self-attention and applies its mask itself")
        q, k, v = project_qkv(attn, hidden_states)                                                 # (B, Sl, H, hd)
        if rotary_emb is not None:
            q, k = self.rotate(q, rotary_emb), self.rotate(k, rotary_emb)
        k = self.keys(attn, shard, k)
        out = exchanged_attention(self.owner, q, k, v)                                           # (B, Sl, H, hd)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

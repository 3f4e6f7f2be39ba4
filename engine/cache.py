"""Step caching keyed per request, inside step-level batches: diffusers' FirstBlockCache, one state per row group.

diffusers' caches (`diffusers.hooks.apply_first_block_cache`, `MagCacheConfig`, ...) hold one state per
model (per `cache_context` name: "cond" and "uncond" in the Wan pipeline) and decide once per forward for
the whole batch. Here one forward holds the rows of several requests at different steps, joining and
leaving between steps, so the state and the decision must belong to the rows, not to the model. What is
kept from diffusers is everything that makes a decision (`FirstBlockCacheConfig`'s metric, threshold and
update rules, line for line); what is new is where the state lives and what a decision does to a batch:

- **A unit** is the rows diffusers' Wan pipeline gives the transformer in one call for a request: its
  conditional rows (one per prompt), or its unconditional rows. Each unit has its own `UnitState`, kept on
  the request (`WorkerRequest.cache_state`, keyed by (expert, branch)): it is created when the request's
  first step runs, never shared, and dropped when the request finishes denoising or is released (a
  cancelled request's state goes with its worker record). Wan 2.2's two experts have a state each, as
  diffusers' hook applied to each transformer has.
- **The head block** (the model's first block) runs for every row. For each caching unit the metric is
  diffusers': mean |r - r_prev| / mean |r_prev| of the head's residual r = output - input, r_prev the
  residual of the unit's last *computed* step; the unit recomputes when it exceeds the threshold (or it
  has no previous residual).
- **The other blocks run on the recomputing rows only** (gathered into a sub-batch, with their text,
  modulation and masks); a skipping row gets head output + the residual the remaining blocks added the
  last time its unit recomputed (scattered back). When every row skips, no other block runs at all.
- **Under sequence parallelism** every rank holds a slice of each row's tokens; the metric's two sums
  (over real tokens only: padding is excluded) are all-reduced over the sequence-parallel group in one
  small all-reduce per forward, so every rank takes the same decision and no rank meets a collective the
  others skip. With one rank the metric is diffusers' expression on the same tensor, so one worker equals
  diffusers' hook. Under CFG-parallel a unit (one branch) lives on one half of the workers; the halves
  exchange their decisions only to report them (one small all-gather per forward).

The model code calls `StepRun.decide` after the head block, `enter` to take the recomputing rows, and
`leave` to put the batch back together (`engine/models/latte.py`'s forward; `attach_wan`'s hooks on a
diffusers Wan transformer's blocks).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from diffusers.hooks import HookRegistry, ModelHook

from engine import comm
from engine.request import RequestError

KINDS = ("first_block",)
#: named presets: diffusers' defaults (`FirstBlockCacheConfig()`), and the thresholds `longserve bench speed`
#: measured on the trained tiny-latte (docs/benchmarks.md)
PRESETS = {
    "first_block": {"kind": "first_block", "threshold": 0.05},
}
FIELDS = {"first_block": {"threshold"}}
OFF = (None, False, "none", "off", "")
HOOK = "longserve_step_cache"


def parse_cache(value, field_name: str = "cache") -> dict | None:
    """A request's (or the engine's default) `cache` -> a normalised dict, or None for no caching.

    Accepted: a preset name ("first_block"), a dict `{"kind": "first_block", "threshold": 0.1}` (the fields
    of diffusers' `FirstBlockCacheConfig`), the same dict as JSON text (forms, the CLI), or none/off/null.
    Errors are `RequestError`s naming the field ("cache", "cache.threshold", ...)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in OFF:
            return None
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise RequestError(field_name, f"{field_name} is not valid JSON: {e.msg}") from None
        elif text in PRESETS:
            return dict(PRESETS[text])
        else:
            raise RequestError(field_name, f"{field_name} must be one of {', '.join(PRESETS)}, 'none', or an object "
                                           f"like {{\"kind\": \"first_block\", \"threshold\": 0.1}}; got {value!r}")
    if value in OFF:
        return None
    if not isinstance(value, dict):
        raise RequestError(field_name, f"{field_name} must be a preset name or an object; got {type(value).__name__}")
    kind = value.get("kind")
    if kind not in KINDS:
        raise RequestError(f"{field_name}.kind", f"{field_name}.kind must be one of {', '.join(KINDS)}; got {kind!r}")
    unknown = sorted(set(value) - FIELDS[kind] - {"kind"})
    if unknown:
        raise RequestError(f"{field_name}.{unknown[0]}", f"{field_name}.{unknown[0]} is not a field of a {kind} "
                                                         f"cache (it takes: {', '.join(sorted(FIELDS[kind]))})")
    out = dict(PRESETS[kind], **value)
    threshold = out["threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or not 0 <= threshold <= 100:
        raise RequestError(f"{field_name}.threshold", f"{field_name}.threshold must be a number in [0, 100]; "
                                                      f"got {threshold!r}")
    out["threshold"] = float(threshold)
    return out


# -- per-request state -------------------------------------------------------------------------------------


@dataclass
class UnitState:
    """What diffusers' `FBCSharedBlockState` holds, for one unit (a request's cond or uncond rows, one expert)."""

    head_residual: torch.Tensor | None = None      # the head block's residual at the last computed step
    tail_residual: torch.Tensor | None = None      # what the other blocks added at the last computed step


@dataclass
class Unit:
    """One unit's rows in this rank's forward: [start, start + rows) of the batch."""

    start: int
    rows: int
    state: UnitState | None         # None: this unit does not cache (always recomputes)
    threshold: float = 0.0
    compute: bool = True            # the decision of this forward


@dataclass
class StepRun:
    """The caching of one forward on this rank (see the module docstring). Item = a row of the batch (a latent)."""

    units: list[Unit]
    decided: bool = False
    index: torch.Tensor | None = None     # the recomputing items, when some skip
    metric_calls: int = 0
    #: told the recomputing items when the other blocks start (None: all of them again, after the last block),
    #: for per-row state outside the blocks' arguments (engine/lora.py's adapters per row)
    on_take: list[Callable] = field(default_factory=list)

    @property
    def items(self) -> int:
        return sum(u.rows for u in self.units)

    def decide(self, head_in: torch.Tensor, head_out: torch.Tensor, valid: Callable | None, pg) -> None:
        """Each caching unit's decision from its head residual. head_in, head_out: (items, ...) on this rank;
        `valid(t)`: the real tokens of such a tensor (its padding cut), or None when there is none; `pg`: the
        ranks that share these rows' tokens (the metric is summed over them)."""
        residual = head_out - head_in
        asking = [u for u in self.units if u.state is not None and u.state.head_residual is not None]
        if asking:
            if pg.world_size == 1 and valid is None:
                ratios = [_diffusers_ratio(residual[u.start:u.start + u.rows], u.state.head_residual) for u in asking]
            else:
                cut = valid or (lambda t: t)
                sums = torch.stack([torch.stack([
                    (cut(residual[u.start:u.start + u.rows]) - cut(u.state.head_residual)).abs().double().sum(),
                    cut(u.state.head_residual).abs().double().sum()]) for u in asking])    # (units, 2)
                sums = comm.all_reduce(sums, pg).tolist()
                ratios = [d / p if p else math.inf for d, p in sums]
                self.metric_calls += 1
            for u, ratio in zip(asking, ratios):
                u.compute = ratio > u.threshold
        for u in self.units:
            if u.state is not None and u.compute:      # a copy: a view would keep the whole batch alive
                u.state.head_residual = residual[u.start:u.start + u.rows].clone()
        self.decided = True
        computing = [i for u in self.units if u.compute for i in range(u.start, u.start + u.rows)]
        self.index = None if len(computing) == self.items else \
            torch.tensor(computing, dtype=torch.long, device=head_out.device)
        if self.index is not None:
            for listener in self.on_take:
                listener(self.index)

    @property
    def all_compute(self) -> bool:
        return self.index is None

    @property
    def computing(self) -> int:
        return self.items if self.index is None else len(self.index)

    def take(self, x: torch.Tensor | None, per_item: int = 1) -> torch.Tensor | None:
        """The recomputing items' rows of `x` (dim 0 = items x per_item, items outermost)."""
        if x is None or self.index is None:
            return x
        if per_item == 1:
            return x.index_select(0, self.index)
        return x.unflatten(0, (self.items, per_item)).index_select(0, self.index).flatten(0, 1)

    def leave(self, out: torch.Tensor, head_out: torch.Tensor) -> torch.Tensor:
        """The batch back together after the last block. out: the recomputing items' output (computing, ...);
        head_out: every item's head output, in the same layout -> (items, ...). Stores each recomputing
        caching unit's residual; a skipping unit's rows are head_out + its stored residual."""
        if self.index is None:
            full = out
        else:
            for listener in self.on_take:
                listener(None)
            full = torch.empty_like(head_out)
            if len(self.index):
                full.index_copy_(0, self.index, out)
        for u in self.units:
            rows = slice(u.start, u.start + u.rows)
            if u.compute:
                if u.state is not None:
                    u.state.tail_residual = full[rows] - head_out[rows]
            else:
                full[rows] = u.state.tail_residual + head_out[rows]
        return full


def _diffusers_ratio(residual: torch.Tensor, previous: torch.Tensor) -> float:
    """`FBCHeadBlockHook._should_compute_remaining_blocks`'s metric, the same expression."""
    absmean = (residual - previous).abs().mean()
    return (absmean / previous.abs().mean()).item()


# -- the per-worker manager ------------------------------------------------------------------------------


@dataclass
class StepCache:
    """A family's step caching on one worker: builds each forward's `StepRun` from the batch's requests and
    counts, per request, the transformer blocks evaluated and skipped (`timings["blocks"]`,
    `timings["blocks_skipped"]`: one block applied to one latent row, cond and uncond rows counted apart)."""

    blocks: int                                     # transformer blocks in one forward (Latte: spatial + temporal)
    head_blocks: int = 1
    active: StepRun | None = field(default=None, repr=False)

    @contextmanager
    def step(self, reqs, scope: int, cfg_groups):
        """While the batch `reqs` runs one forward: `active` is this rank's `StepRun` (None when no request of
        the batch caches). `scope`: the denoiser (Wan 2.2's expert); `cfg_groups`: CFG-parallel's groups, or
        None (this rank then runs every row)."""
        units, owners = [], []
        for r in reqs:
            config = r.spec.options.get("cache")
            rows = r.spec.batch_size
            for branch in ((0, 1) if r.spec.use_cfg else (1,)):
                state = None
                if config is not None and self.blocks > self.head_blocks:
                    state = r.cache_state.setdefault((scope, branch), UnitState())
                units.append(Unit(0, rows, state, config["threshold"] if config else 0.0))
                owners.append((r, branch))
        if cfg_groups is not None:      # order_rows: every unconditional half first; this rank runs one half
            order = [i for b in (0, 1) for i, (_, branch) in enumerate(owners) if branch == b]
            mine = [i for i in order if owners[i][1] == cfg_groups.index]
        else:
            order = mine = list(range(len(units)))
        start = 0
        for i in mine:
            units[i].start, start = start, start + units[i].rows
        caching = any(units[i].state is not None for i in mine)
        self.active = StepRun([units[i] for i in mine]) if caching else None
        try:
            yield self.active
        finally:
            self.active = None
        skipped = [not u.compute for u in units]
        if cfg_groups is not None and any(u.state is not None for u in units):
            flags = torch.tensor([skipped[i] for i in mine], dtype=torch.int64, device=cfg_groups.pair.device)
            both = comm.all_gather(flags[None], 0, cfg_groups.pair).tolist()        # (2, my units)
            theirs = [i for i in order if owners[i][1] != cfg_groups.index]
            for i, flag in zip(theirs, both[1 - cfg_groups.index]):
                skipped[i] = bool(flag)
        for u, (r, _), skip in zip(units, owners, skipped):
            done = self.head_blocks if skip else self.blocks
            r.timings["blocks"] = r.timings.get("blocks", 0) + done * u.rows
            r.timings["blocks_skipped"] = r.timings.get("blocks_skipped", 0) + (self.blocks - done) * u.rows


# -- diffusers' Wan transformer: hooks on its blocks ------------------------------------------------------


class _BlockHook(ModelHook):
    """On a `WanTransformerBlock` (hidden_states, encoder_hidden_states, temb, rotary_emb): the head decides
    and hands the recomputing rows on; the others run on those rows; the last puts the batch back."""

    def __init__(self, wan: "WanStepCache", position: str):
        super().__init__()
        self.wan, self.position = wan, position           # "head" | "middle" | "tail"

    def new_forward(self, module, hidden_states, encoder_hidden_states, temb, *rest):
        # rest: rotary_emb (and SkyReels-V2's attention_mask, which is per token, not per row)
        run = self.wan.cache.active
        forward = self.fn_ref.original_forward
        if run is None:
            return forward(hidden_states, encoder_hidden_states, temb, *rest)
        if self.position == "head":
            out = forward(hidden_states, encoder_hidden_states, temb, *rest)
            shard = self.wan.shard()
            valid = None
            if shard is not None and (shard.sp.world_size > 1 or shard.stop - shard.start != out.shape[1]):
                valid = functools.partial(_first_tokens, n=shard.stop - shard.start)     # my real tokens
            run.decide(hidden_states, out, valid, shard.sp.pg if shard is not None else _SOLO)
            self.wan.head_out, self.wan.sliced = out, None
            return run.take(out)
        if run.computing:
            rows = self.wan.rows(encoder_hidden_states, temb)
            hidden_states = forward(hidden_states, *rows, *rest)
        if self.position == "tail":
            head_out, self.wan.head_out = self.wan.head_out, None
            self.wan.sliced = None
            return run.leave(hidden_states, head_out)
        return hidden_states


def _first_tokens(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[:, :n]


class _Solo:
    world_size = 1


_SOLO = _Solo()


class WanStepCache:
    """Step caching hooks on a diffusers Wan / SkyReels-V2 transformer's blocks, registered *before*
    `WanSequenceParallel`'s (so they see a block's input after the token cut and the per-token modulation
    cut). They do nothing while `cache.active` is None: the forward is then diffusers' own, bit for bit."""

    def __init__(self, model, cache: StepCache):
        self.cache = cache
        self.sp_owner = None            # the WanSequenceParallel wrapping the model, for its current shard
        self.head_out = None
        self.sliced = None
        blocks = list(model.blocks)
        if len(blocks) < 2:
            return                      # nothing to skip: one block is the head
        for i, block in enumerate(blocks):
            position = "head" if i == 0 else "tail" if i == len(blocks) - 1 else "middle"
            HookRegistry.check_if_exists_or_initialize(block).register_hook(_BlockHook(self, position), HOOK)

    def shard(self):
        return None if self.sp_owner is None else self.sp_owner.shard

    def rows(self, encoder_hidden_states: torch.Tensor, temb: torch.Tensor) -> tuple:
        """The recomputing rows of the text and the modulation: cut once per forward (every block gets the same
        tensors)."""
        key = (id(encoder_hidden_states), id(temb))
        if self.sliced is None or self.sliced[0] != key:
            run = self.cache.active
            self.sliced = (key, (run.take(encoder_hidden_states), run.take(temb)))
        return self.sliced[1]

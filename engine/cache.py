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

from longserve.engine import comm
from longserve.engine.errors import RequestError
from longserve.engine.sharding import current_shard

KINDS = ("first_block", "mag")
#: named presets: diffusers' defaults (`FirstBlockCacheConfig()`, `MagCacheConfig()`)
PRESETS = {
    "first_block": {"kind": "first_block", "threshold": 0.05},
    "mag": {"kind": "mag", "threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2},
}
FIELDS = {"first_block": {"threshold"},
          "mag": {"threshold", "max_skip_steps", "retention_ratio", "mag_ratios", "calibrate"}}
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
    out["threshold"] = _number(out["threshold"], f"{field_name}.threshold", 0, 100)
    if kind == "mag":
        out["retention_ratio"] = _number(out["retention_ratio"], f"{field_name}.retention_ratio", 0, 1)
        skips = out["max_skip_steps"]
        if isinstance(skips, bool) or not isinstance(skips, int) or not 0 <= skips <= 1000:
            raise RequestError(f"{field_name}.max_skip_steps", f"{field_name}.max_skip_steps must be an integer in "
                                                               f"[0, 1000]; got {skips!r}")
        calibrate = out.pop("calibrate", False)
        if not isinstance(calibrate, bool):
            raise RequestError(f"{field_name}.calibrate", f"{field_name}.calibrate must be true or false; got "
                                                          f"{calibrate!r}")
        if calibrate:
            out["calibrate"] = True
        if out.get("mag_ratios") is not None:
            out["mag_ratios"] = checked_mag_ratios(out["mag_ratios"], f"{field_name}.mag_ratios")
    return out


def _number(value, field_name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise RequestError(field_name, f"{field_name} must be a number in [{low:g}, {high:g}]; got {value!r}")
    return float(value)


def checked_mag_ratios(value, field_name: str) -> list:
    """A list of positive ratios (one expert), or a list of such lists (one per expert of a two-expert model)."""
    def one(v, name):
        if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= 10_000:
            raise RequestError(name, f"{name} must be a list of 1 to 10000 positive numbers (a MagCache "
                                     f"calibration); got {type(v).__name__}")
        return [_number(x, name, 1e-6, 1e6) for x in v]

    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        if len(value) > 2:
            raise RequestError(field_name, f"{field_name} takes one list per expert (at most 2); got {len(value)}")
        return [one(v, f"{field_name}[{i}]") for i, v in enumerate(value)]
    return one(value, field_name)


def mag_ratios_for(config: dict, expert: int, steps: int) -> torch.Tensor:
    """The calibration one expert uses, at a request's step count on it: diffusers' `MagCacheConfig` resamples
    `mag_ratios` to `num_inference_steps` with `nearest_interp`; the same here, per request and per expert."""
    from diffusers.hooks.mag_cache import nearest_interp

    ratios = config["mag_ratios"]
    if ratios and isinstance(ratios[0], list):
        ratios = ratios[min(expert, len(ratios) - 1)]
    ratios = torch.tensor(ratios)
    return ratios if len(ratios) == steps else nearest_interp(ratios, steps)


# -- per-request state -------------------------------------------------------------------------------------


@dataclass
class UnitState:
    """What diffusers' `FBCSharedBlockState` holds, for one unit (a request's cond or uncond rows, one expert)."""

    head_residual: torch.Tensor | None = None      # the head block's residual at the last computed step
    tail_residual: torch.Tensor | None = None      # what the other blocks added at the last computed step
    # MagCache (diffusers' `MagCacheState`): what every block added at the last computed step, and the
    # accumulated ratio, error and skipped steps since; `step`: this unit's forwards so far
    residual: torch.Tensor | None = None
    step: int = 0
    ratio: torch.Tensor | float = 1.0
    err: torch.Tensor | float = 0.0
    skipped: int = 0
    calibration: list = field(default_factory=list)
    ratios: torch.Tensor | None = None             # the calibration at this request's steps on this expert


@dataclass
class Unit:
    """One unit's rows in this rank's forward: [start, start + rows) of the batch."""

    start: int
    rows: int
    state: UnitState | None         # None: this unit does not cache (always recomputes)
    threshold: float = 0.0
    compute: bool = True            # the decision of this forward
    config: dict | None = None      # the request's `cache`
    steps: int = 0                  # MagCache: the request's steps on this expert
    head: int | None = None         # where its rows start among the rows that run the head (None: none run it)

    @property
    def mag(self) -> bool:
        return self.state is not None and self.config["kind"] == "mag"

    def mag_decide(self) -> None:
        """`MagCacheHeadHook`'s decision, before the head: from the calibration alone (no tensor of this step), so
        it is the same on every rank by construction. diffusers' arithmetic on its float32 ratio tensor is kept."""
        state, config = self.state, self.config
        self.compute = True
        if not config.get("calibrate"):
            current = state.step
            scale = state.ratios[current] if current < len(state.ratios) else 1.0
            if current >= int(config["retention_ratio"] * self.steps + 0.5):
                state.ratio = state.ratio * scale
                state.skipped += 1
                state.err = state.err + abs(1.0 - state.ratio)
                if state.residual is not None and state.err <= config["threshold"] \
                        and state.skipped <= config["max_skip_steps"]:
                    self.compute = False
                else:
                    state.ratio, state.skipped, state.err = 1.0, 0, 0.0
        state.step += 1


@dataclass
class StepRun:
    """The caching of one forward on this rank (see the module docstring). Item = a row of the batch (a latent).

    Three layouts of the batch's rows: all of them ("full"); those that run the head block ("head": all but the
    MagCache units that skip, decided in `before`); those that run the other blocks ("rest": the head's rows but
    the FirstBlockCache units that skip, decided in `decide`). Indices are into "full"."""

    units: list[Unit]
    decided: bool = False
    index: torch.Tensor | None = None       # "rest" in "full", when some rows skip
    head_index: torch.Tensor | None = None  # "head" in "full", when some MagCache rows skip
    rest_in_head: torch.Tensor | None = None  # "rest" in "head"
    head_in: torch.Tensor | None = None     # every row's input to the head (MagCache's residuals start there)
    metric_calls: int = 0
    #: told the rows that go on when fewer rows run (an index into "full"; None: all of them again, after the last
    #: block), for per-row state outside the blocks' arguments (engine/lora.py's adapters per row)
    on_take: list[Callable] = field(default_factory=list)
    _valid: Callable | None = None
    _pg: object = None

    @property
    def items(self) -> int:
        return sum(u.rows for u in self.units)

    def _rows(self, units) -> list[int]:
        return [i for u in units for i in range(u.start, u.start + u.rows)]

    def _tell(self, index: torch.Tensor | None) -> None:
        for listener in self.on_take:
            listener(index)

    def before(self, head_in: torch.Tensor, valid: Callable | None = None, pg=None) -> None:
        """Before the head: the MagCache units decide (from their calibration). head_in: (items, ...) on this rank;
        `valid`/`pg` as in `decide` (for a calibrating unit's metric)."""
        self.head_in, self._valid, self._pg = head_in, valid, pg or _SOLO
        for u in self.units:
            if u.mag:
                u.mag_decide()
        start = 0
        for u in self.units:
            u.head = start if u.compute else None
            start += u.rows if u.compute else 0
        if start < self.items:
            self.head_index = torch.tensor(self._rows([u for u in self.units if u.compute]), dtype=torch.long,
                                           device=head_in.device)
            self._tell(self.head_index)

    @property
    def head_rows(self) -> int:
        return self.items if self.head_index is None else len(self.head_index)

    def take_head(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of `x` (in "full") that run the head."""
        return x if x is None or self.head_index is None else x.index_select(0, self.head_index)

    def decide(self, head_in: torch.Tensor, head_out: torch.Tensor, valid: Callable | None, pg) -> None:
        """Each FirstBlockCache unit's decision from its head residual. head_in, head_out: the head's rows
        ("head" layout) on this rank; `valid(t)`: the real tokens of such a tensor (its padding cut), or None when
        there is none; `pg`: the ranks that share these rows' tokens (the metric is summed over them)."""
        if self.head_in is None:            # a model without MagCache's early decision (Latte)
            self.before(head_in, valid, pg)
        residual = head_out - head_in
        first = [u for u in self.units if u.head is not None and u.state is not None and not u.mag]
        asking = [u for u in first if u.state.head_residual is not None]
        if asking:
            if pg.world_size == 1 and valid is None:
                ratios = [_diffusers_ratio(residual[u.head:u.head + u.rows], u.state.head_residual) for u in asking]
            else:
                cut = valid or (lambda t: t)
                sums = torch.stack([torch.stack([
                    (cut(residual[u.head:u.head + u.rows]) - cut(u.state.head_residual)).abs().double().sum(),
                    cut(u.state.head_residual).abs().double().sum()]) for u in asking])    # (units, 2)
                sums = comm.all_reduce(sums, pg).tolist()
                ratios = [d / p if p else math.inf for d, p in sums]
                self.metric_calls += 1
            for u, ratio in zip(asking, ratios):
                u.compute = ratio > u.threshold
        for u in first:
            if u.compute:                   # a copy: a view would keep the whole batch alive
                u.state.head_residual = residual[u.head:u.head + u.rows].clone()
        self.decided = True
        rest = [u for u in self.units if u.compute]
        if len(rest) == len(self.units):
            return
        device = head_out.device
        self.index = torch.tensor(self._rows(rest), dtype=torch.long, device=device)
        self.rest_in_head = torch.tensor([i for u in rest for i in range(u.head, u.head + u.rows)],
                                         dtype=torch.long, device=device)
        self._tell(self.index)

    @property
    def all_compute(self) -> bool:
        return self.index is None

    @property
    def computing(self) -> int:
        return self.items if self.index is None else len(self.index)

    def take(self, x: torch.Tensor | None, per_item: int = 1, layout: str = "full") -> torch.Tensor | None:
        """The recomputing items' rows of `x` (dim 0 = items x per_item, items outermost; `layout`: whether `x`
        holds every row, "full", or the head's rows, "head")."""
        index = self.index if layout == "full" else self.rest_in_head
        if x is None or index is None:
            return x
        if per_item == 1:
            return x.index_select(0, index)
        return x.unflatten(0, (len(x) // per_item, per_item)).index_select(0, index).flatten(0, 1)

    def leave(self, out: torch.Tensor, head_out: torch.Tensor) -> torch.Tensor:
        """The batch back together after the last block. out: the recomputing items' output (computing, ...);
        head_out: the head's output for its rows ("head" layout; for a model without MagCache's early decision,
        every row) -> (items, ...). Stores each recomputing unit's residual; a skipping FirstBlockCache unit's rows
        are head_out + its stored residual, a skipping MagCache unit's head_in + its own."""
        if self.rest_in_head is None:
            at_head = out
        else:
            at_head = torch.empty_like(head_out)
            if len(self.rest_in_head):
                at_head.index_copy_(0, self.rest_in_head, out)
        for u in self.units:
            if u.head is None or u.state is None or u.mag:
                continue
            rows = slice(u.head, u.head + u.rows)
            if u.compute:
                u.state.tail_residual = at_head[rows] - head_out[rows]
            else:
                at_head[rows] = u.state.tail_residual + head_out[rows]
        if self.head_index is None:
            full = at_head
        else:
            full = torch.empty((self.items, *at_head.shape[1:]), dtype=at_head.dtype, device=at_head.device)
            if len(self.head_index):
                full.index_copy_(0, self.head_index, at_head)
        for u in self.units:
            if not u.mag:
                continue
            rows = slice(u.start, u.start + u.rows)
            if u.compute:
                residual = full[rows] - self.head_in[rows]
                if u.config.get("calibrate"):
                    u.state.calibration.append(self._calibration_ratio(residual, u.state.residual))
                u.state.residual = residual
            else:
                full[rows] = self.head_in[rows] + u.state.residual
        if self.index is not None or self.head_index is not None:
            self._tell(None)
        return full

    def _calibration_ratio(self, current: torch.Tensor, previous: torch.Tensor | None) -> float:
        """`MagCacheBlockHook._perform_calibration_step`: the mean over tokens of |r_t| / |r_t-1| (the norm over
        the channels); summed over the sequence-parallel ranks' real tokens."""
        if previous is None:
            return 1.0
        ratio = torch.linalg.norm(current.float(), dim=-1) / (torch.linalg.norm(previous.float(), dim=-1) + 1e-8)
        if self._pg.world_size == 1 and self._valid is None:
            return ratio.mean().item()
        ratio = (self._valid or (lambda t: t))(ratio)
        total, count = comm.all_reduce(torch.stack([ratio.double().sum(), torch.tensor(float(ratio.numel()),
                                                    dtype=torch.float64, device=ratio.device)]), self._pg).tolist()
        return total / count


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
    def step(self, reqs, scope: int, cfg_groups, steps: Callable | None = None):
        """While the batch `reqs` runs one forward: `active` is this rank's `StepRun` (None when no request of
        the batch caches). `scope`: the denoiser (Wan 2.2's expert); `cfg_groups`: CFG-parallel's groups, or
        None (this rank then runs every row); `steps(r)`: the request's denoising steps on this denoiser (MagCache
        resamples its calibration to them; default all of them)."""
        units, owners = [], []
        for r in reqs:
            config = r.spec.options.get("cache")
            rows = r.spec.batch_size
            for branch in ((0, 1) if r.spec.cfg_at(r.steps_done) else (1,)):
                state, n = None, 0
                if config is not None and (self.blocks > self.head_blocks or config["kind"] == "mag"):
                    state = r.cache_state.setdefault((scope, branch), UnitState())
                    if config["kind"] == "mag":
                        n = steps(r) if steps is not None else r.spec.num_inference_steps
                        if state.ratios is None and not config.get("calibrate"):
                            state.ratios = mag_ratios_for(config, scope, n)
                units.append(Unit(0, rows, state, config["threshold"] if config else 0.0, config=config, steps=n))
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
        ran = set(mine)
        for i, (u, (r, branch), skip) in enumerate(zip(units, owners, skipped)):
            done = (0 if u.config["kind"] == "mag" else self.head_blocks) if skip else self.blocks
            if i in ran and u.state is not None and u.config.get("calibrate") and (branch == 1 or cfg_groups):
                ratios = r.timings.setdefault("mag_ratios", [])         # per expert: the conditional rows'
                ratios += [[] for _ in range(scope + 1 - len(ratios))]   # (under CFG-parallel, this half's)
                ratios[scope] = list(u.state.calibration)
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
            shard = current_shard(self.wan.model)
            valid = None
            if shard is not None and (shard.sp.world_size > 1 or shard.real_tokens != hidden_states.shape[1]):
                valid = functools.partial(_first_tokens, n=shard.real_tokens)            # my real tokens
            pg = shard.sp.pg if shard is not None else _SOLO
            self.wan.sliced = None
            run.before(hidden_states, valid, pg)                  # MagCache's rows decide before the head
            x = run.take_head(hidden_states)
            out = forward(x, *self.wan.rows(encoder_hidden_states, temb, "head"), *rest) if len(x) else x
            run.decide(x, out, valid, pg)                         # FirstBlockCache's after it
            self.wan.head_out = out
            return run.take(out, layout="head")
        if run.computing:
            rows = self.wan.rows(encoder_hidden_states, temb, "rest")
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
    """Step caching hooks on a diffusers Wan / SkyReels-V2 transformer's blocks, registered *before* its
    shard plan's (so they see a block's input after the token cut and the per-token modulation cut; the
    running forward's shard, `engine.sharding.current_shard`, says how many of its tokens are real). They do
    nothing while `cache.active` is None: the forward is then diffusers' own, bit for bit."""

    def __init__(self, model, cache: StepCache):
        self.cache, self.model = cache, model
        self.head_out = None
        self.sliced = None
        blocks = list(model.blocks)
        if len(blocks) < 2:
            return                      # nothing to skip: one block is the head
        for i, block in enumerate(blocks):
            position = "head" if i == 0 else "tail" if i == len(blocks) - 1 else "middle"
            HookRegistry.check_if_exists_or_initialize(block).register_hook(_BlockHook(self, position), HOOK)

    def rows(self, encoder_hidden_states: torch.Tensor, temb: torch.Tensor, layout: str) -> tuple:
        """The text and the modulation of the rows that run the head (`layout` "head") or the other blocks
        ("rest"): cut once per forward (every block gets the same tensors)."""
        key = (id(encoder_hidden_states), id(temb), layout)
        if self.sliced is None or self.sliced[0] != key:
            run = self.cache.active
            take = run.take_head if layout == "head" else run.take
            self.sliced = (key, (take(encoder_hidden_states), take(temb)))
        return self.sliced[1]

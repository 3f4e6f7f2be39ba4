"""LoRA adapters: loaded once at start through diffusers' own loaders, chosen per request, applied row by row.

    --lora style=/loras/style.safetensors:0.8 --lora fast=high.safetensors,low.safetensors
    VideoPipeline.from_pretrained(model, loras={"style": "/loras/style.safetensors", "fast": ("fast.safetensors", 1.0)})
    pipe(prompt, lora=[{"name": "style", "scale": 0.6}])  # or lora={"style": 0.6}; HTTP: "lora": [{...}]

**Loading** (every worker: each holds the whole transformer). The file goes through the checkpoint's diffusers
pipeline class: `lora_state_dict` turns kohya / musubi tuner and original-Wan keys into diffusers' own, and
`load_lora_weights(..., adapter_name=NAME)` lets peft wrap the targeted layers (`peft.tuners.lora.Linear`, with
`lora_A[NAME]`, `lora_B[NAME]`, alpha and rank), onto `transformer_2` too for a two-expert Wan 2.2 checkpoint
(`load_into_transformer_2=True`; one file for both experts, or `HIGH,LOW`: one per expert). A file that does not
fit fails at start, naming the flag: every module it names must have received the adapter (peft silently skips
the names a model lacks when some others match). Then peft's own forward is switched off (`disable_lora()`): the
wrapped layers compute their base layer alone, and the adapters are added here, per row.

**Per row.** A batch holds rows of different requests, each with its own adapters and scales (or none). A hook on
every wrapped layer's *base* layer adds, to the rows of each adapter present in the batch,

    out[rows_a] += lora_B_a(lora_A_a(x[rows_a])) * s_row * alpha_a / r_a           # s_row: the request's scale

which is peft's vanilla LoRA term with `set_adapters(name, s)`'s scaling, computed on the sub-batch of the rows
that use it, as peft's mixed-batch forward (`LoraLayer._mixed_batch_forward`) does. That forward is not used
as it is: it takes one scale per adapter (the layer's `scaling[name]`), so two requests with one adapter at two
scales could not share a batch, nor could a request carry two adapters; and diffusers' transformer forward
does not pass its `adapter_names` on to the layers. When every row carries the same adapters at the same scales
(the common case, one request or a few-step fleet) the term is computed on the whole input, exactly peft's
expression, so one request equals diffusers' `set_adapters(name, s)` forward. The hook sits on the base layer,
inside peft's wrapper, so hooks the sequence-parallel plan puts on the wrapper (`proj_out`'s output gather)
see base plus adapter.

**Which rows.** The family's `step` tells, per request, its adapters and how many rows it has in the forward
this rank runs: all of them under Ulysses / Ring / USP (each rank holds every row of a shard of the sequence),
half of them under CFG-parallel (each half of the workers runs the unconditional or the conditional rows, and a
request has as many of each, in the same request order). A layer whose input holds k rows per batch row (the
time embedding of Wan 2.2 TI2V's per-token timesteps, flattened to (B S_l, C)) gets each row's adapters k times
over, consecutively. A layer fed one row for the whole batch (SkyReels' fps
projection) cannot follow the rows: an adapter on it is refused at start (the hook also refuses any input whose
row count is not a multiple of the batch's, when the rows differ).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from typing import Any, NamedTuple

from longserve.engine.errors import RequestError

MAX_SCALE = 10.0                 # largest |scale| a request may ask for (kohya users go up to about 3)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
FLAG = "--lora"
#: modules fed one row for the whole batch (SkyReels' fps embedding): an adapter there cannot be per row
BROADCAST_MODULES = ("fps_embedding", "fps_projection")


class LoraAdapter(NamedTuple):
    """One adapter loaded at start: `path` (on every expert, or the high-noise one when `path_2` is set)."""

    name: str
    path: str
    scale: float = 1.0                 # its scale when a request names it without one
    path_2: str | None = None          # the low-noise expert's file (`transformer_2`), if another

    def flag(self) -> str:
        paths = self.path if self.path_2 is None else f"{self.path},{self.path_2}"
        return f"{FLAG} {self.name}={paths}"


# -- the adapters given at start (coordinator side: no torch) -------------------------------------------


def parse_adapter(text: str) -> LoraAdapter:
    """"NAME=PATH[:SCALE]" (PATH: "HIGH,LOW" for a two-expert model) -> LoraAdapter; ValueError naming the flag."""
    name, sep, rest = str(text).partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"{FLAG} must look like NAME=PATH[:SCALE]; got {text!r}")
    path, scale = rest.strip(), 1.0
    head, colon, tail = path.rpartition(":")
    if colon:
        try:
            scale, path = float(tail), head
        except ValueError:
            pass                       # a colon inside the path, not a scale
    high, comma, low = path.partition(",")
    return _adapter(name.strip(), high.strip(), scale, low.strip() if comma else None)


def _adapter(name, path, scale=1.0, path_2=None) -> LoraAdapter:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{FLAG}: adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    if not isinstance(path, str) or not path or (path_2 is not None and (not isinstance(path_2, str) or not path_2)):
        raise ValueError(f"{FLAG} {name}: the path must be a non-empty string (or HIGH,LOW); got {path!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or abs(scale) > MAX_SCALE:
        raise ValueError(f"{FLAG} {name}: the scale must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}]; got {scale!r}")
    return LoraAdapter(name, path, float(scale), path_2)


def parse_adapters(value: Any) -> tuple[LoraAdapter, ...]:
    """The `loras` option in any of its shapes -> a tuple of LoraAdapter (ValueError naming the flag).

    - `{"style": "style.safetensors", "fast": ("fast.safetensors", 0.8), "moe": ("high.safetensors,low.safetensors",
      1.0)}`: name -> path or (path, scale), as diffusers users write `load_lora_weights(path, adapter_name=name)`;
    - `["style=style.safetensors:0.8", ...]`: the command line's NAME=PATH[:SCALE] strings (hashable as a tuple);
    - LoraAdapter tuples (what the config holds once parsed).
    """
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        items = []
        for name, v in value.items():
            if isinstance(v, (list, tuple)) and len(v) == 2:
                path, scale = v
            else:
                path, scale = v, 1.0
            if isinstance(path, os.PathLike):
                path = os.fspath(path)
            if not isinstance(path, str):
                raise ValueError(f"{FLAG} {name}: give a path or (path, scale); got {v!r}")
            high, comma, low = path.partition(",")
            items.append(_adapter(name, high, scale, low if comma else None))
    elif isinstance(value, (list, tuple)):
        items = [LoraAdapter(*v) if isinstance(v, (tuple, list)) and not isinstance(v, str)
                 else parse_adapter(v) for v in value]
        items = [_adapter(*a) for a in items]
    else:
        raise ValueError(f"loras must be a dict {{name: path or (path, scale)}} or a list of NAME=PATH[:SCALE]; "
                         f"got {type(value).__name__}")
    names = [a.name for a in items]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{FLAG}: adapter name {name!r} is given twice")
    return tuple(items)


def check_adapters(adapters: tuple[LoraAdapter, ...], family, desc) -> tuple[LoraAdapter, ...]:
    """At start, on the coordinator: the family loads adapters, each file exists, is safetensors and holds LoRA
    weights (names only: its tensors are read by the workers). Paths come back absolute. ValueError naming the
    flag and the adapter."""
    from longserve.weights import resolve_lora

    if not adapters:
        return ()
    if not getattr(family, "supports_lora", False):
        raise ValueError(f"{FLAG}: a {desc.family} model takes no LoRA adapters here (the Wan family's "
                         f"checkpoints do)")
    checked = []
    for a in adapters:
        if a.path_2 is not None and not desc.capabilities.two_experts:
            raise ValueError(f"{a.flag()}: two files (HIGH,LOW) are for a two-expert checkpoint (Wan 2.2 A14B); "
                             f"this one has one transformer")
        paths = []
        for path in (a.path, a.path_2):
            if path is None:
                paths.append(None)
                continue
            try:
                resolved = resolve_lora(path)
                keys = _safetensors_keys(resolved)
            except (OSError, ValueError) as e:
                raise ValueError(f"{a.flag()}: {e}") from None
            if not any("lora" in k for k in keys):
                raise ValueError(f"{a.flag()}: {resolved} holds no LoRA weights (no key names lora_A/lora_B or "
                                 f"lora_down/lora_up)")
            paths.append(str(resolved))
        checked.append(a._replace(path=paths[0], path_2=paths[1]))
    return tuple(checked)


def _safetensors_keys(path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


# -- a request's adapters (coordinator side) ------------------------------------------------------------


def check_request(value: Any, adapters: tuple[LoraAdapter, ...]) -> list[dict]:
    """A request's `lora` -> [{"name", "scale"}, ...] (RequestError naming "lora").

    Shapes: `[{"name": "style", "scale": 0.8}, ...]` (the HTTP field), `{"style": 0.8}`, `["style"]` or `"style"`
    (a missing or null scale is the adapter's start scale), and, for a multipart form, the JSON text of any of
    these or "style:0.8,fast".
    """
    if value is None or value == [] or value == {}:
        return []
    if isinstance(value, str):
        value = _from_text(value)
    if isinstance(value, dict):
        value = [{"name": k, "scale": v} for k, v in value.items()]
    if not isinstance(value, (list, tuple)):
        raise RequestError("lora", f"lora must be a list of {{\"name\": ..., \"scale\": ...}}; got "
                                   f"{type(value).__name__}")
    known = {a.name: a for a in adapters}
    out = []
    for item in value:
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or "name" not in item or set(item) - {"name", "scale"}:
            raise RequestError("lora", f"each lora entry is {{\"name\": NAME, \"scale\": NUMBER}} (scale optional); "
                                       f"got {item!r}")
        name = item["name"]
        if not isinstance(name, str) or name not in known:
            have = ", ".join(sorted(known)) or "none (start the server with --lora NAME=PATH)"
            raise RequestError("lora", f"unknown LoRA adapter {name!r}; this model has: {have}")
        scale = item.get("scale")
        scale = known[name].scale if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_SCALE:
            raise RequestError("lora", f"lora {name!r}: scale must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}]; "
                                       f"got {scale!r}")
        if any(e["name"] == name for e in out):
            raise RequestError("lora", f"lora {name!r} is given twice")
        out.append({"name": name, "scale": float(scale)})
    return out


def _from_text(text: str):
    text = text.strip()
    if text[:1] in "[{\"":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RequestError("lora", f"lora is not valid JSON: {text[:80]!r}") from None
    items = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, colon, scale = part.partition(":")
        if not colon:
            items.append({"name": name})
            continue
        try:
            items.append({"name": name, "scale": float(scale)})
        except ValueError:
            raise RequestError("lora", f"lora {name!r}: scale must be a number; got {scale!r}") from None
    return items


# -- on the workers ---------------------------------------------------------------------------------------


class _Plan:
    """One forward's adapters row by row: either the same for every row (`uniform`), or groups of rows."""

    def __init__(self, rows: list[tuple]):
        self.n = len(rows)
        self.uniform = rows[0] if all(r == rows[0] for r in rows) else None
        groups: dict[str, tuple[list, list]] = {}
        for i, row in enumerate(rows):
            for name, scale in row:
                idx, scales = groups.setdefault(name, ([], []))
                idx.append(i)
                scales.append(scale)
        self.groups = groups
        self._tensors: dict = {}

    def tensors(self, name: str, k: int, device):
        """The rows of `name` in an input with k rows per batch row, and their scales (long, float32)."""
        import torch

        key = (name, k, device)
        if key not in self._tensors:
            idx, scales = self.groups[name]
            rows = torch.tensor(idx, dtype=torch.long)
            rows = (rows[:, None] * k + torch.arange(k)).flatten()               # (len(idx) k,)
            self._tensors[key] = (rows.to(device), torch.tensor(scales).repeat_interleave(k).to(device))
        return self._tensors[key]


class LoraSet:
    """The adapters on this worker's transformer(s), and their per-row application (see the module docstring)."""

    def __init__(self, pipe, adapters: tuple[LoraAdapter, ...]):
        self.pipe = pipe
        self.adapters = {a.name: a for a in adapters}
        self.experts = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
        for a in adapters:
            for i, model in enumerate(self.experts):
                self._load(pipe, a, a.path_2 if i == 1 and a.path_2 else a.path, i, model)
        self.layers = []
        self._hooked: set[int] = set()
        self._hook_new_layers()
        self._plan: _Plan | None = None
        self._rows: list | None = None

    def _hook_new_layers(self, first: bool = False) -> None:
        for model in self.experts:
            model.disable_lora()                   # peft's forward adds nothing; the hooks below add per row
            for layer in _lora_layers(model):
                if id(layer) in self._hooked:
                    continue
                self._hooked.add(id(layer))
                self.layers.append(layer)
                # first among the base layer's hooks: a layer wrapped while serving kept the hooks the shard plan
                # put on it (an output gather), which must see base + adapter, as they do on a wrapper made at start
                layer.base_layer.register_forward_hook(self._hook(layer), prepend=True)

    def add(self, a: LoraAdapter) -> None:
        """Load one more adapter while serving (between two steps: no forward runs): the same load as at start
        (`_load`: diffusers' loader, its checks), on a model whose shard plan and hooks are in place; a load that
        fails leaves the model as it was (ValueError naming the adapter)."""
        if a.name in self.adapters:
            raise ValueError(f"{a.flag()}: an adapter named {a.name!r} is loaded already")
        try:
            for i, model in enumerate(self.experts):
                self._load(self.pipe, a, a.path_2 if i == 1 and a.path_2 else a.path, i, model)
        except BaseException:
            self._drop(a.name)
            raise
        self.adapters[a.name] = a
        self._hook_new_layers()
        from longserve.engine.sharding import sharded_of

        for model in self.experts:               # the shard plan's hooks onto the layers peft just wrapped
            sharded = sharded_of(model)
            if sharded is not None:
                sharded.rehook()

    def remove(self, name: str) -> None:
        """Unload an adapter (between two steps): its weights leave every wrapped layer; a layer left with none
        computes its base layer alone, as before the adapter came."""
        self._drop(name)
        self.adapters.pop(name, None)

    def _drop(self, name: str) -> None:
        for model in self.experts:
            if any(name in getattr(layer, "lora_A", {}) for layer in _lora_layers(model)):
                model.delete_adapters(name)
            model.disable_lora()

    @staticmethod
    def _load(pipe, a: LoraAdapter, path: str, expert: int, model) -> None:
        import warnings

        from diffusers.utils import logging as diffusers_logging

        try:
            state = type(pipe).lora_state_dict(path)        # kohya / musubi / original Wan -> diffusers' keys
        except Exception as e:
            raise ValueError(f"{a.flag()}: {path} is not a LoRA diffusers can read for {type(pipe).__name__} "
                             f"({type(e).__name__}: {e})") from None
        prefix = "transformer."
        others = sorted({k.split(".")[0] for k in state if not k.startswith(prefix)})
        if others or not state:
            raise ValueError(f"{a.flag()}: {path} holds weights for {', '.join(others) or 'nothing'}; only the "
                             f"transformer takes LoRA weights here")
        wanted = {k[len(prefix):].split(".lora_")[0] for k in state}
        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()     # diffusers lists the other adapters' keys as "missing"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)   # peft: "multiple adapters in the model"
                # the path, not `state`: a diffusers-format file keeps its rank and alpha in its metadata
                pipe.load_lora_weights(path, adapter_name=a.name,
                                       **({"load_into_transformer_2": True} if expert else {}))
        except Exception as e:
            raise ValueError(f"{a.flag()}: {path} does not fit this model's "
                             f"{'transformer_2' if expert else 'transformer'} ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[-1][:300]})") from None
        finally:
            diffusers_logging.set_verbosity(level)
        got = {name for name, layer in model.named_modules(remove_duplicate=False)
               if a.name in getattr(layer, "lora_A", {})}
        missing = sorted(wanted - got)
        if missing:
            raise ValueError(f"{a.flag()}: {path} names {len(missing)} module(s) this model does not have, e.g. "
                             f"{missing[0]!r}")
        for name, layer in model.named_modules():
            if a.name in getattr(layer, "lora_embedding_A", {}):
                raise ValueError(f"{a.flag()}: adapters on embedding tables ({name}) are not applied per request "
                                 f"here")
            if a.name not in getattr(layer, "lora_A", {}):
                continue
            if layer.use_dora.get(a.name) or a.name in getattr(layer, "lora_variant", {}):
                raise ValueError(f"{a.flag()}: DoRA and other LoRA variants are not applied per request here "
                                 f"({name})")
            if name.split(".")[0] in BROADCAST_MODULES:
                raise ValueError(f"{a.flag()}: {name} gets one row for the whole batch (the fps embedding), so an "
                                 f"adapter on it cannot follow each request's rows")

    @contextlib.contextmanager
    def applied(self, per_request: list[tuple[list[dict], int]]):
        """Within the block, forwards add each row's adapters. `per_request`: (its `lora`, its rows in this rank's
        forward), in the forward's row order."""
        rows = [tuple((e["name"], e["scale"]) for e in lora) for lora, n in per_request for _ in range(n)]
        self._rows = rows
        self._plan = _Plan(rows) if any(rows) else None
        try:
            yield self
        finally:
            self._plan = self._rows = None

    def take(self, index) -> None:
        """Only the rows `index` of the forward's batch go on (step caching runs the blocks after the first for
        the rows that recompute, engine/cache.py); None: the whole batch again."""
        rows = self._rows if index is None else [self._rows[i] for i in index.tolist()]
        self._plan = _Plan(rows) if rows and any(rows) else None

    def _hook(self, layer):
        def add_adapters(module, args, out):
            plan = self._plan
            if plan is None:
                return None
            x = args[0]
            if plan.uniform is not None:               # every row alike: peft's own expression, on the whole input
                dtype = out.dtype
                for name, scale in plan.uniform:
                    if name in layer.lora_A:
                        lora_A = layer.lora_A[name]
                        xa = x.to(lora_A.weight.dtype)
                        out = out + layer.lora_B[name](lora_A(layer.lora_dropout[name](xa))) * _scaling(layer, name,
                                                                                                         scale)
                return out.to(dtype)
            k, rest = divmod(x.shape[0], plan.n)
            if rest or k == 0:
                raise ValueError(f"a LoRA layer got {x.shape[0]} rows for a batch of {plan.n} whose rows carry "
                                 f"different adapters: it cannot tell which row is whose")
            for name in plan.groups:
                if name not in layer.lora_A:
                    continue
                rows, scales = plan.tensors(name, k, x.device)
                lora_A = layer.lora_A[name]
                sub = x.index_select(0, rows).to(lora_A.weight.dtype)                  # (m, ...)
                delta = layer.lora_B[name](lora_A(layer.lora_dropout[name](sub)))     # (m, ..., out)
                factor = (scales * _scaling(layer, name, 1.0)).to(delta.dtype)
                delta = delta * factor.view(-1, *([1] * (delta.ndim - 1)))
                out.index_add_(0, rows, delta.to(out.dtype))
            return out

        return add_adapters


def _scaling(layer, name: str, scale: float) -> float:
    """What peft's `set_scale(name, scale)` (diffusers' `set_adapters(name, scale)`) makes the layer's scaling."""
    if layer.use_rslora.get(name, False):
        return scale * layer.lora_alpha[name] / math.sqrt(layer.r[name])
    return scale * layer.lora_alpha[name] / layer.r[name]


def _lora_layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer) and len(m.lora_A)]


def step_rows(lora: LoraSet | None, reqs, sizes: list[int], cfg_parallel: bool):
    """The context a family's step runs its forward in: each request's adapters on its rows of this rank's forward
    (`sizes`: the requests' rows in the whole batch; under CFG-parallel a rank runs half of each)."""
    if lora is None:
        return contextlib.nullcontext()      # yields None: no adapters to follow the rows
    return lora.applied([(r.spec.lora, n // 2 if cfg_parallel else n) for r, n in zip(reqs, sizes)])

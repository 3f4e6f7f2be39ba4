"""Regional `torch.compile` of a transformer's repeated block (the `compile` engine option, "blocks").

The idea is diffusers' `ModelMixin.compile_repeated_blocks`: compile the one block class a DiT repeats (Wan's
`WanTransformerBlock`, Latte's spatial and temporal `BasicTransformerBlock`s) rather than the whole model, so
that the compiled graph is shared by every block (their weights are graph inputs: torch's
`inline_inbuilt_nn_modules`) and compiling costs one block's worth of tracing, not the model's.

Where the compiled function sits matters here. diffusers' `HookRegistry` (the sequence-parallel hooks of
`engine/sharding.py`, step caching's of `engine/cache.py`) replaces `module.forward` with a chain that ends in
the forward it found when the first hook was registered. `compile_block` installs the compiled forward *before*
any hook, so it is that innermost forward: the hooks stay eager Python around it (their per-request decisions,
row gathers and token cuts are never traced, never guarded on), and the block's own arithmetic is compiled.
`block.compile()` would instead compile `_call_impl`, which calls whatever `forward` is at call time: the
whole hook chain would be traced, with a graph break at every data-dependent decision of step caching.

Batch sizes change from step to step (step-level batching, and step caching's sub-batches of the rows that
recompute), so the row dimension of every input is marked dynamic before the first call: one graph serves
every batch size (torch specialises sizes 0 and 1, so a batch of one row costs one more graph). Other sizes
(tokens, prompt length) follow torch's automatic dynamic shapes: the first change recompiles once with them
symbolic. The Wan family's sequence-parallel attention is a graph break by design (`engine/sharding.py`,
`exchanged_attention`: collectives on our process groups); the code after a break is compiled as its own
frame whose inputs carry no mark, so there a batch size change recompiles once, then that frame is dynamic too.
`dynamic=True` would avoid those recompiles but made the first compile 3-4 times slower on tiny-wan (symbolic
shapes everywhere), so it is not used. `compiled_graphs()` counts the graphs a process has compiled; the engine
reports it (`ModelInfo.compiled_graphs`, `stats().compiled_graphs`) and the tests check it stops growing.

CUDA graphs (`cuda_graphs`, live models on CUDA): the compiled blocks in torch.compile's "reduce-overhead" mode, so
inductor records each graph's kernels once per shape and replays them (one launch instead of one per kernel). In
the live loop every forward has the same shapes from the first chunk (a chunk's tokens; the cached attention,
whose key count grows until the window is full, runs eager between the graphs), and the loop marks each forward
as a new step (`torch.compiler.cudagraph_mark_step_begin`), so a replay may reuse the last forward's buffers.
"""

from __future__ import annotations

import torch

MODES = ("none", "blocks")
#: the `torch.compile` backend; "aot_eager" (no code generation: the mechanism, fast) is the tests' knob
BACKENDS = ("inductor", "aot_eager", "eager")


class CompiledBlock:
    """A block's forward, compiled; called with the forward's arguments. `eager` is the forward as it was, for
    callers that swap the block's insides per call (Latte's embedded baselines), which a graph would guard on."""

    def __init__(self, forward, backend: str, mode: str | None = None):
        self.eager = forward
        self.compiled = torch.compile(forward, backend=backend, dynamic=None, mode=mode)
        self.__wrapped__ = forward              # inspect.signature (diffusers' hooks) sees the block's own

    def __call__(self, *args, **kwargs):
        rows = args[0].shape[0]
        for x in (*args, *kwargs.values()):
            # every input with a row per batch row: (rows, ...) -> the row count is symbolic in the graph
            if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == rows:
                torch._dynamo.maybe_mark_dynamic(x, 0)
        return self.compiled(*args, **kwargs)


def compile_block(block: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> CompiledBlock:
    """Compile `block`'s forward in place (before any diffusers hook is registered on it: see the module doc).
    `mode`: torch.compile's ("reduce-overhead": the graphs replayed as CUDA graphs, the `cuda_graphs` option)."""
    if backend not in BACKENDS:
        raise ValueError(f"compile_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if getattr(block, "_diffusers_hook", None) is not None and block._diffusers_hook.hooks:
        raise RuntimeError(f"compile {type(block).__name__} before registering hooks on it (they would be traced)")
    if isinstance(block.__dict__.get("forward"), CompiledBlock):
        return block.forward
    compiled = CompiledBlock(block.forward, backend, mode)
    block.forward = compiled                # an instance attribute, as diffusers' hooks set it
    return compiled


def compile_blocks(blocks, backend: str = "inductor", mode: str | None = None) -> int:
    """Compile each block of `blocks` (the model's repeated block class); returns how many."""
    n = 0
    for block in blocks:
        compile_block(block, backend, mode)
        n += 1
    return n


def eager(block: torch.nn.Module):
    """The block's uncompiled forward (its compiled one's `eager`), or its forward when it is not compiled."""
    forward = block.__dict__.get("forward")
    return forward.eager if isinstance(forward, CompiledBlock) else block.forward


def compiled_graphs() -> int:
    """Graphs compiled in this process so far (torch._dynamo's counter: one per compile or recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

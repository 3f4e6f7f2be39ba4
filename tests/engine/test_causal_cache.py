"""The live loop's KV cache (engine/models/causal.py), in process on tiny-live's transformer: keys are stored rotated
(each chunk's keys rotated once, when computed; the sink re-rotated once per chunk from its copy before RoPE), the
attention reads one contiguous slice with no mask from the first chunk on, and the outputs equal a plain reference
that keeps keys unrotated and rotates every cached key at cache-relative positions on every forward (the loop
before issue 41), past the window's eviction; a chunk's noises are drawn at its start as the steps drew them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longserve.engine.dist import ParallelGroup
from longserve.engine.models import causal
from longserve.engine.models.causal import CausalConfig, CausalWan, KVCache, rotate
from longserve.engine.parallel import make_sequence_parallel
from longserve.weights.causal_wan import load_causal_transformer, read_causal_config
from longserve.weights.registry import TINY_MODELS

CHUNKS = 9                      # tiny-live: 12 cached frames (6 sink + a ring of 6), 3 a chunk: evicting from chunk 5
SOLO = make_sequence_parallel(ParallelGroup(rank=0, world_size=1, device=torch.device("cpu")), "ulysses")


@pytest.fixture(scope="module")
def model():
    d = TINY_MODELS["tiny-live"]
    return load_causal_transformer(d), CausalConfig.from_dict(read_causal_config(d))


class UnrotatedCache(KVCache):
    """The plain way: keys stored before RoPE, every cached key rotated at its cache-relative position (oldest
    cached frame 0, the chunk after the cached ones) on every forward, invalid slots masked."""

    def prepare(self, frames, rotary):
        ft, order = self.frame_tokens, sorted((f, s) for s, f in enumerate(self.slot_frame) if f >= 0)
        pos = [0] * self.cfg.capacity
        for rank, (_, s) in enumerate(order):
            pos[s] = rank
        pos += list(range(len(order), len(order) + frames)) + [0] * (self.cfg.frames_per_block - frames)
        rows = [rotary(p, 1) for p in pos]
        self.key_rope = torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
        valid = [f >= 0 for f in self.slot_frame] + [True] * frames + [False] * (self.cfg.frames_per_block - frames)
        self.mask = torch.tensor(valid).repeat_interleave(ft)
        self.chunk = slice(self.cfg.capacity * ft, (self.cfg.capacity + frames) * ft)

    def attend(self, layer, q, k, v):
        ft, chunk = self.frame_tokens, self.chunk
        self.k[layer, :, chunk], self.v[layer, :, chunk] = k, v
        cos, sin = self.key_rope
        out = F.scaled_dot_product_attention(rotate(q, cos[chunk], sin[chunk])[None], rotate(self.k[layer], cos,
                                             sin)[None], self.v[layer][None], attn_mask=self.mask.view(1, 1, 1, -1))
        if self.write:
            for i in range((chunk.stop - chunk.start) // ft):
                s = self.slot_of(self.frames_written + i)
                self.k[layer, :, s * ft:(s + 1) * ft] = k[:, i * ft:(i + 1) * ft]
                self.v[layer, :, s * ft:(s + 1) * ft] = v[:, i * ft:(i + 1) * ft]
        return out[0]


def run_chunks(cw, cache, chunks=CHUNKS, seed=0):
    """Two denoising forwards and the context pass a chunk (the loop's shape): every denoising output."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 7, cw.model.config.text_dim, generator=g)
    outs = []
    with torch.no_grad():
        for _ in range(chunks):
            x = torch.randn(1, 4, cw.cfg.frames_per_block, 8, 8, generator=g)
            for t in (1000.0, 500.0):
                outs.append(cw(x, torch.tensor([t]), text, SOLO, [cache], [0], [False]))
            cw(x, torch.tensor([0.0]), text, SOLO, [cache], [0], [True])
    return torch.stack(outs)


def new_cache(cw, kind=KVCache):
    c = cw.model.config
    return kind(cw.cfg, c.num_layers, cw.frame_tokens(8, 8), c.num_attention_heads, c.attention_head_dim, 7,
                c.num_attention_heads, torch.float32, "cpu")


def test_cached_keys_stored_rotated_equal_rotating_every_key_on_every_forward_past_the_window(model):
    cw = CausalWan(*model)
    got, want = run_chunks(cw, new_cache(cw)), run_chunks(cw, new_cache(cw, UnrotatedCache))
    assert want[-4:].std() > 0.1
    assert (got - want).abs().max() <= 1e-5


def test_the_first_chunks_attend_to_the_filled_prefix_with_no_mask(model, monkeypatch):
    """Chunk 0..2 (the cache not yet full) read [cached frames | chunk] as one slice, unmasked: flash / cuDNN
    kernels run from the first chunk."""
    cw = CausalWan(*model)
    cache = new_cache(cw)
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask, k.shape[-2], cache.frames_written))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(causal.F, "scaled_dot_product_attention", recording)
    run_chunks(cw, cache, chunks=3)
    ft, layers = cw.frame_tokens(8, 8), cw.model.config.num_layers
    self_attn = [c for c in calls if c[1] != 7]                          # cross-attention reads the 7 text tokens
    assert len(self_attn) == 3 * 3 * layers
    assert all(mask is None for mask, _, _ in calls)
    assert sorted({(keys, written) for _, keys, written in self_attn}) == [(3 * ft, 0), (6 * ft, 3), (9 * ft, 6)]


def test_cached_keys_are_rotated_once_and_the_sink_once_per_chunk_past_the_window(model, monkeypatch):
    cw = CausalWan(*model)
    cache = new_cache(cw)
    rotated = []

    def counting(x, cos, sin):
        rotated.append(x.shape[-2])
        return rotate(x, cos, sin)

    monkeypatch.setattr(causal, "rotate", counting)
    run_chunks(cw, cache)
    ft, layers, cfg = cw.frame_tokens(8, 8), cw.model.config.num_layers, cw.cfg
    chunk, sink = cfg.frames_per_block * ft, cfg.sink_size * ft
    evicting = CHUNKS - cfg.capacity // cfg.frames_per_block - 1          # chunks that start with the window moved
    assert cache.sink_rotations == evicting == 4
    # per forward and layer: the chunk's queries and keys; per chunk past the window: the sink, every layer at once
    assert sorted(rotated) == sorted([chunk] * (2 * layers * 3 * CHUNKS) + [sink] * evicting)


def test_frame_positions_are_diffusers_rotary_table_inside_it_and_go_on_past_it(model):
    """`FrameRotary` builds the rows on the device from a frame offset: diffusers' own table bit for bit within its
    1024 frames, and the same formula (float64 angles) past it, where a long stream's keys sit."""
    from longserve.engine.models.causal import FrameRotary

    transformer = model[0]
    rotary = FrameRotary(transformer.rope, 8, 8, torch.float32, "cpu")
    cos, sin = transformer.rope(torch.empty(1, 1, 12, 8, 8))                 # (1, 12 frames * 16 tokens, 1, hd)
    got = rotary(0, 12)
    assert torch.equal(got[0], cos[0, :, 0]) and torch.equal(got[1], sin[0, :, 0])
    assert torch.equal(rotary(5, 3)[0], got[0][5 * 16:8 * 16])              # any offset: the same rows
    far = rotary(5000, 2)[0]                                                  # past the 1024-frame table
    t_dim = transformer.rope.t_dim
    inverse = 1.0 / (10000.0 ** (torch.arange(0, t_dim, 2, dtype=torch.float64) / t_dim))
    want = torch.cos(torch.tensor([5000.0, 5001.0], dtype=torch.float64)[:, None] * inverse).repeat_interleave(2, 1)
    assert torch.equal(far.view(2, 16, -1)[:, 0, :t_dim], want.float())
    assert torch.equal(far.view(2, 16, -1)[:, :, t_dim:], got[0].view(12, 16, -1)[:2, :, t_dim:])


def test_a_chunk_s_noises_are_drawn_at_its_start_as_the_steps_drew_them_one_by_one(monkeypatch):
    """Item 3 of issue 41: one draw per chunk from the request's CPU generator, the same numbers in the same order as
    a draw per step (seeded videos unchanged, on any device), and no device sync inside the loop unless bench asks."""
    from longserve.engine.families import causal_wan

    family = object.__new__(causal_wan.CausalWanFamily)
    family.cfg = CausalConfig.from_dict(read_causal_config(TINY_MODELS["tiny-live"]))
    family.pg = ParallelGroup(rank=0, world_size=1, device=torch.device("cpu"))
    request = causal_wan.CausalRequest(spec=None, num_steps=0, batch_key=(), num_frames=0,
                                       generator=torch.Generator().manual_seed(7))
    shape = (1, 4, 3, 5, 7)                             # 420 numbers: not a multiple of torch's 16-wide normal fill
    got = family._chunk_noise(request, shape)
    g = torch.Generator().manual_seed(7)
    want = torch.stack([torch.randn(shape, generator=g) for _ in family.cfg.timesteps])
    assert got.shape == (4, *shape) and torch.equal(got, want)
    assert torch.equal(torch.randn(3, generator=request.generator), torch.randn(3, generator=g))   # same state after
    syncs = []
    monkeypatch.setattr(causal_wan, "sync_cuda", lambda: syncs.append(1))
    family.timed = False
    family._timed_sync()
    family.timed = True
    family._timed_sync()
    assert syncs == [1]

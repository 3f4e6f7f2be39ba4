"""LSS building blocks in one process: sharding layouts, the global-position causal mask
with the online softmax, label shifting, window plans, and the memory tracker."""

import math

import pytest
import torch

from longserve.engine import lss, lss_jobs
from longserve.engine.memory import LiveTensorTracker, PeakMemory
from longserve.pipelines.scoring import plan_windows


@pytest.mark.parametrize("length,world,zigzag",
                         [(20, 3, True), (20, 3, False), (7, 4, True), (3, 4, False), (16, 4, True)])
def test_layout_covers_every_position_once_and_pads_only_the_end(length, world, zigzag):
    layout = lss.SequenceLayout(length, world, zigzag)
    seen = []
    for r in range(world):
        pos = layout.positions(r)
        assert pos.numel() == layout.local_length
        for off, p0, n in layout.segments(r):
            assert torch.equal(pos[off:off + n], torch.arange(p0, p0 + n))
            seen += range(p0, p0 + n)
        assert all(int(p) >= length for p in pos if int(p) not in seen)  # the rest is padding, past the end
    assert sorted(seen) == list(range(length))


def test_zigzag_gives_rank_r_chunks_r_and_2n_minus_1_minus_r():
    layout = lss.SequenceLayout(24, 3, zigzag=True)  # 6 chunks of 4
    assert layout.ranges(0) == [(0, 4), (20, 24)]
    assert layout.ranges(1) == [(4, 8), (16, 20)]
    assert layout.ranges(2) == [(8, 12), (12, 16)]
    # causal work (number of (q, k) pairs with k <= q) is balanced exactly
    work = [sum(p + 1 for p in layout.positions(r).tolist()) for r in range(3)]
    assert len(set(work)) == 1


def _naive_attention(q, k, v, window=None):
    """Reference: full (L x L) scores, mask key position <= query position (+ window), GQA by repeat."""
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    L = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    pos = torch.arange(L)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= (pos[:, None] - pos[None, :]) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v  # (B, H, L, D)


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk_elems", [1 << 20, 64])  # one block / many tiny blocks (16 x 1024 minimum)
def test_online_softmax_over_shuffled_key_blocks_equals_global_causal_attention(zigzag, window, chunk_elems):
    torch.manual_seed(0)
    L, N, B, H, Hkv, D = 37, 3, 2, 4, 2, 8
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    want = _naive_attention(q, k, v, window)
    layout = lss.SequenceLayout(L, N, zigzag)
    P = layout.padded_length

    def pad(x):  # NaN padding must never leak
        return torch.nn.functional.pad(x, (0, 0, 0, P - L), value=float("nan"))

    qp, kp, vp = pad(q), pad(k), pad(v)
    for r in range(N):
        pos = layout.positions(r)
        attn = lss.OnlineSoftmaxAttention(qp[:, :, pos], Hkv, layout.segments(r), D ** -0.5, window, chunk_elems)
        for src in [(r - s) % N for s in range(N)]:  # ring order: own block first, not position order
            kv = lss._fuse_kv(kp[:, :, layout.positions(src)], vp[:, :, layout.positions(src)])
            attn.add_block(kv, layout.segments(src))
        out = attn.finish(torch.float32)  # (B, l, H, D)
        for off, p0, n in layout.segments(r):
            torch.testing.assert_close(out[:, off:off + n].transpose(1, 2), want[:, :, p0:p0 + n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_sdpa_kernel_on_gathered_kv_equals_global_causal_attention(zigzag, heads, kv_heads):
    """The "sdpa" kernel of strategy lss: per query segment one SDPA call over the key prefix with a
    lower-right causal mask. Segments start at p0 > 0 on every rank but the first (top-left would be
    wrong there, see the next test); zigzag gathers keys out of position order; GQA; NaN padding."""
    torch.manual_seed(0)
    L, N, B, D = 37, 3, 2, 8
    q, k, v = torch.randn(B, heads, L, D), torch.randn(B, kv_heads, L, D), torch.randn(B, kv_heads, L, D)
    want = _naive_attention(q, k, v)
    layout = lss.SequenceLayout(L, N, zigzag)
    P = layout.padded_length
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, P - L), value=float("nan"))  # noqa: E731
    qp, kp, vp = pad(q), pad(k), pad(v)
    kv_all = torch.cat([lss._fuse_kv(kp[:, :, layout.positions(r)], vp[:, :, layout.positions(r)])
                        for r in range(N)])  # what the all-gather returns: rank 0's rows, then rank 1's, ...
    for r in range(N):
        out = lss.sdpa_segments(qp[:, :, layout.positions(r)], kv_all, layout, r, D ** -0.5)  # (B, l, H, D)
        for off, p0, n in layout.segments(r):
            torch.testing.assert_close(out[:, off:off + n].transpose(1, 2), want[:, :, p0:p0 + n], rtol=1e-5, atol=1e-5)


def test_score_job_settings_are_sized_for_the_device():
    job = lss_jobs.ScoreJob(ids=torch.arange(4), windows=[(0, 4, 1)])
    cpu, cuda = job.resolved("cpu"), job.resolved(torch.device("cuda", 0))
    assert (cpu.attn_kernel, cpu.logits_chunk_elems, cpu.mlp_chunk_tokens) == (
        "blocks", lss.DEFAULT_LOGITS_CHUNK_ELEMS, lss.DEFAULT_MLP_CHUNK_TOKENS)
    assert (cuda.attn_kernel, cuda.attn_chunk_elems, cuda.logits_chunk_elems, cuda.mlp_chunk_tokens) == (
        "sdpa", lss.CUDA_ATTN_CHUNK_ELEMS, lss.CUDA_LOGITS_CHUNK_ELEMS, lss.CUDA_MLP_CHUNK_TOKENS)
    # at a 128k vocabulary a CUDA logits chunk is thousands of tokens, not 4 (one launch per chunk)
    assert cuda.logits_chunk_elems // 128256 >= 2048 > cpu.logits_chunk_elems // 128256
    explicit = lss_jobs.ScoreJob(ids=torch.arange(4), windows=[(0, 4, 1)], attn_kernel="blocks", mlp_chunk_tokens=0)
    assert explicit.resolved("cuda").attn_kernel == "blocks" and explicit.resolved("cuda").mlp_chunk_tokens == 0


def test_top_left_causal_alignment_would_be_wrong_for_a_later_segment():
    # The trap the global-position mask avoids: is_causal=True with Lq < Lk aligns the
    # query block to keys 0..Lq-1, so a later segment's queries would miss their keys.
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    want = _naive_attention(q, k, v)[:, :, 4:]  # queries at positions 4..7
    top_left = torch.nn.functional.scaled_dot_product_attention(q[:, :, 4:], k, v, is_causal=True)
    assert not torch.allclose(top_left, want, atol=1e-3)
    layout = lss.SequenceLayout(8, 2)
    attn = lss.OnlineSoftmaxAttention(q[:, :, 4:], 2, layout.segments(1), 0.5, None, 1 << 20)
    attn.add_block(lss._fuse_kv(k, v), [(0, 0, 8)])
    torch.testing.assert_close(attn.finish(torch.float32).transpose(1, 2), want)


def test_labels_are_shifted_before_sharding_and_windows_score_only_new_tokens():
    ids = torch.arange(100, 110)
    assert lss_jobs.shifted_targets(ids, 0, 10, 1).tolist() == list(range(101, 110)) + [-100]
    # window [4, 10) whose tokens before 7 were scored by an earlier window
    assert lss_jobs.shifted_targets(ids, 4, 10, 7).tolist() == [-100, -100, 107, 108, 109, -100]
    assert plan_windows(10, None, None) == [(0, 10, 1)]
    assert plan_windows(10, 10, 3) == [(0, 10, 1)]
    assert plan_windows(10, 4, 2) == [(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # every token but the first is scored exactly once when stride < window
    scored = []
    for b, e, f in plan_windows(50, 8, 3):
        scored += [j for j in range(b + 1, e) if j >= f]
    assert scored == list(range(1, 50))


def test_memory_tracker_counts_new_storage_until_freed_and_ignores_views_and_inplace():
    weights = torch.randn(256, 256)
    with PeakMemory("cpu") as mem:
        a = torch.empty(1024, 256)           # 1 MiB
        b = a.view(-1).add_(1)               # in place, a view: nothing new
        c = weights @ weights                # 256 KiB -> 1.25 MiB
        del a, b                             # 256 KiB live
        d = torch.empty(512, 256)            # 512 KiB -> 768 KiB live
        del c, d
    assert mem.peak_bytes == 1024 * 256 * 4 + 256 * 256 * 4
    tracker = LiveTensorTracker()
    with tracker:
        x = torch.zeros(100)
        del x
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 400

"""Radial attention's static mask (engine/attention.py) against a hand-written definition, and the sparse attention
against a dense reference that applies that definition: off is PyTorch SDPA exactly, on is the masked softmax."""

import pytest
import torch

from longserve.engine.attention import RadialMask, radial_attention, radial_keys_per_query


def by_hand(frames, T, dense):
    """The rule with Python integers: frames within `dense` whole; at distance d, keys within T // 2^(k+1) of the
    query's own position, 2^k <= d < 2^(k+1)."""
    S = frames * T
    m = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        for j in range(S):
            d = abs(i // T - j // T)
            if d <= dense:
                m[i, j] = True
            else:
                k = d.bit_length() - 1
                m[i, j] = abs(i % T - j % T) <= T // 2 ** (k + 1)
    return m


@pytest.mark.parametrize("frames, T, dense", [(9, 8, 1), (6, 5, 0), (17, 4, 2)])
def test_the_mask_is_the_hand_written_rule(frames, T, dense):
    mask = RadialMask(frames, T, dense)
    assert torch.equal(mask.dense(), by_hand(frames, T, dense))
    assert torch.equal(mask.visible(T, 2 * T, 3 * T, T), by_hand(frames, T, dense)[T:3 * T, 3 * T:4 * T])
    assert float(mask.dense().sum()) / (frames * T) == pytest.approx(radial_keys_per_query(frames, T, dense))


def test_every_query_keeps_its_own_position_at_every_distance_and_the_mask_is_symmetric():
    m = RadialMask(16, 8).dense()
    assert torch.equal(m, m.T)
    same_position = torch.arange(128)[:, None] % 8 == torch.arange(128)[None, :] % 8
    assert bool(m[same_position].all())


def test_keys_per_query_grow_like_log_frames_not_frames():
    T = 64
    short, long = radial_keys_per_query(8, T), radial_keys_per_query(64, T)
    assert long / short < 2.5, "8x the frames: a dense attention sees 8x the keys, radial about log2 more"
    assert radial_keys_per_query(64, T) < 0.2 * 64 * T


def test_radial_attention_off_is_sdpa_and_on_is_the_masked_softmax():
    g = torch.Generator().manual_seed(0)
    mask = RadialMask(9, 6)
    q, k, v = (torch.randn(2, 3, mask.tokens, 16, generator=g) for _ in range(3))
    assert torch.equal(radial_attention(q, k, v, None), torch.nn.functional.scaled_dot_product_attention(q, k, v))
    scores = (q @ k.transpose(-1, -2)) / 16 ** 0.5
    scores = scores.masked_fill(~by_hand(9, 6, 1), float("-inf"))
    want = scores.softmax(-1) @ v
    got = radial_attention(q, k, v, mask, flex=False)
    assert (got - want).abs().max() <= 1e-5
    assert (got - radial_attention(q, k, v, None)).abs().max() > 1e-3, "the mask should change the output"


def test_the_flex_attention_block_mask_gives_the_same_output():
    g = torch.Generator().manual_seed(1)
    mask = RadialMask(8, 16)
    q, k, v = (torch.randn(1, 2, mask.tokens, 16, generator=g) for _ in range(3))
    try:
        got = radial_attention(q, k, v, mask, flex=True)
    except Exception as e:           # noqa: BLE001 (a torch without FlexAttention on this device)
        pytest.skip(f"FlexAttention does not run here: {e}")
    assert (got - radial_attention(q, k, v, mask, flex=False)).abs().max() <= 1e-5


def test_a_sequence_that_is_not_the_masks_is_refused():
    q = torch.zeros(1, 1, 10, 4)
    with pytest.raises(ValueError, match="covers 3 x 4 = 12 tokens"):
        radial_attention(q, q, q, RadialMask(3, 4))



def test_the_option_runs_the_wan_family_and_is_refused_elsewhere_naming_it(pipeline):
    request = dict(num_frames=9, height=48, width=64, num_inference_steps=2, seed=0)
    dense = pipeline("tiny-wan")("a red ball bouncing", **request).frames
    radial = pipeline("tiny-wan", sparse_attention="radial")("a red ball bouncing", **request).frames
    assert radial.shape == dense.shape and abs(radial - dense).max() > 1e-4
    from longserve.pipelines import VideoPipeline

    with pytest.raises(ValueError, match="sparse_attention='radial' is built for the Wan family"):
        VideoPipeline.from_pretrained("tiny-latte", device="cpu", sparse_attention="radial")

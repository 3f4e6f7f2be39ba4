"""engine/workcount.py (issue 36, Build 7: `bench live`'s machine-independent column): a counted forward of a tiny
Wan transformer gives its batch as forwards, batch x tokens^2 self-attention pairs per layer and batch x tokens x
text rows cross-attention pairs per layer; a boolean mask counts only the keys it lets through."""

import torch
import torch.nn.functional as F

from longserve.engine.workcount import WorkCounter, attended_pairs


def tiny_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=3,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6).eval()


@torch.no_grad()
def test_a_counted_forward_gives_forwards_and_token_pairs():
    model = tiny_wan()
    x, text = torch.randn(2, 4, 3, 8, 8), torch.randn(2, 11, 16)
    tokens = 3 * 4 * 4                                                    # frames x (8 / 2) x (8 / 2)
    with WorkCounter() as counter:
        model(x, timestep=torch.tensor([10, 500]), encoder_hidden_states=text, return_dict=False)
        model(hidden_states=x[:1], timestep=torch.tensor([10]), encoder_hidden_states=text[:1], return_dict=False)
    assert counter.counts() == {"forwards": 3, "self_pairs": 3 * 3 * tokens ** 2, "cross_pairs": 3 * 3 * tokens * 11}
    model(x, timestep=torch.tensor([10, 500]), encoder_hidden_states=text, return_dict=False)     # after exit
    assert counter.counts()["forwards"] == 3


def test_masks_count_the_keys_they_let_through():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4)
    keep = torch.tensor([True, True, False, True, False, False, True])
    assert attended_pairs(q, k) == 5 * 7
    assert attended_pairs(q, k, keep.view(1, 1, 1, -1)) == 5 * 4
    bias = torch.zeros(1, 1, 1, 7).masked_fill(~keep, float("-inf"))
    assert attended_pairs(q, k, bias) == 5 * 4
    assert attended_pairs(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), is_causal=True) == 1 + 2 + 3 + 4
    with WorkCounter() as counter:
        F.scaled_dot_product_attention(q, k, k[..., :4], attn_mask=keep.view(1, 1, 1, -1))
    assert counter.counts()["self_pairs"] == 5 * 4

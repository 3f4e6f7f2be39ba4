"""bf16 numerics, on CPU: our forward in bf16 is as close to diffusers' fp32 forward as diffusers' own bf16
forward is (the GPU run of the same comparison is in tests/engine/test_gpu.py)."""

import pytest
from numerics import bf16_relative_errors


@pytest.mark.parametrize("family", ["latte", "wan"])
def test_our_bf16_forward_is_no_further_from_fp32_than_diffusers_own_bf16_forward(family):
    mine, theirs = bf16_relative_errors(family)
    assert 0 < theirs < 0.1, f"diffusers' own bf16 error {theirs:.2e} should be a bf16 rounding error"
    assert mine <= 1.25 * theirs, f"ours {mine:.2e} vs diffusers' bf16 {theirs:.2e}"

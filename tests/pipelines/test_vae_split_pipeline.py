"""`vae_split="rows"` through VideoPipeline: the Wan, HunyuanVideo-1.5 and LTX-2 families decode every frame's rows
across the workers (engine/vae_split.py) and hand out the frames the one-worker pipeline does, within the
multi-worker transformer's float tolerance (a band decoded without its neighbours' rows would differ by far more
along every band edge: tests/engine/test_vae_split.py)."""

import numpy as np
import pytest

from longserve.pipelines import VideoPipeline

ATOL = 1e-4
CASES = {  # model: (workers, request): latent heights that do not divide by the workers
    "tiny-wan": (3, dict(num_frames=9, height=80, width=48, num_inference_steps=2, seed=3)),
    "tiny-hunyuan15": (2, dict(num_frames=5, height=48, width=32, num_inference_steps=2, seed=3)),
    "tiny-ltx2": (2, dict(num_frames=9, height=96, width=64, num_inference_steps=2, seed=3)),
}


@pytest.mark.parametrize("model", list(CASES))
def test_rows_split_decode_hands_out_the_one_worker_frames(pipeline, model):
    workers, request = CASES[model]
    want = pipeline(model)("a red ball bouncing", **request).frames
    assert want.std() > 0.01, "the reference video should not be flat"
    with VideoPipeline.from_pretrained(model, workers=workers, device="cpu", vae_split="rows") as pipe:
        got = pipe("a red ball bouncing", **request).frames
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= ATOL

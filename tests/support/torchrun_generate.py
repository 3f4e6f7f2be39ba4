"""Run under torchrun by tests/pipelines/test_video_pipeline.py: generate with the torchrun launcher, save the
raw frames."""

import sys

import numpy as np

from longserve.pipelines import VideoPipeline

if __name__ == "__main__":
    out_path, parallel = sys.argv[1], sys.argv[2]
    with VideoPipeline.from_pretrained("tiny-latte", parallel=parallel, device="cpu", launcher="torchrun") as pipe:
        out = pipe("a red ball bouncing", num_frames=13, height=80, width=112, num_inference_steps=3,
                   guidance_scale=4.5, seed=3)
        np.save(out_path, out.frames)
        np.save(out_path + ".workers.npy", np.array(pipe.info.workers))

"""`VideoPipeline`: text-to-video with a Latte-format checkpoint on a pool of parallel workers.

    from pipelines import VideoPipeline
    with VideoPipeline.from_pretrained("tiny-latte", workers=2, parallel="dsp") as pipe:
        out = pipe("a red ball bouncing", num_frames=32, height=64, width=64,
                   num_inference_steps=20, guidance_scale=4.5, seed=0)
        out.save("ball.mp4", fps=8)

`workers=1` gives the frames `diffusers.LattePipeline` gives for the same checkpoint,
prompt, seed (`generator=torch.Generator("cpu").manual_seed(seed)`), steps and
guidance scale; `workers=N` gives the frames `workers=1` gives.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine import video as runtime
from engine.dist import parse_dtype
from engine.latte import STRATEGIES
from engine.pool import make_pool
from weights import resolve_latte

OUTPUT_TYPES = ("np", "latent")
MAX_STEPS = 1000


@dataclass
class VideoOutput:
    """`frames`: float32 (B, T, H, W, 3) in [0, 1] for output_type "np"; latents (B, C, T, h, w) for "latent"."""

    frames: object
    timings: dict = field(default_factory=dict)

    def save(self, path, fps: int = 8, index: int = 0) -> str:
        """Write video `index` of the batch as MP4 (H.264 through imageio-ffmpeg)."""
        save_video(self.frames[index], path, fps)
        return str(path)


def save_video(frames: np.ndarray, path, fps: int = 8) -> None:
    """frames: (T, H, W, 3) float in [0, 1] -> an MP4 at `path`."""
    import imageio

    if not isinstance(frames, np.ndarray) or frames.ndim != 4:
        raise ValueError("save needs decoded frames (output_type='np'), shaped (T, H, W, 3)")
    if not (isinstance(fps, (int, float)) and 0 < fps <= 240):
        raise ValueError(f"fps must be in (0, 240], got {fps!r}")
    pixels = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    with imageio.get_writer(str(path), fps=fps, codec="libx264", quality=8, macro_block_size=1,
                            ffmpeg_log_level="error", output_params=["-pix_fmt", "yuv420p"]) as writer:
        for frame in pixels:
            writer.append_data(frame)


class VideoPipeline:
    """A Latte-format text-to-video pipeline whose transformer runs sharded across `workers` processes."""

    def __init__(self, pool, model_dir: str, parallel: str, info: dict):
        self.pool = pool
        self.model_dir = model_dir
        self.parallel = parallel
        self.info = info

    @classmethod
    def from_pretrained(
        cls,
        model: str = "tiny-latte",
        workers: int = 1,
        parallel: str = "dsp",
        device: str | None = None,
        dtype: str = "float32",
        cfg_parallel: bool = False,
        attention: str = "auto",
        launcher: str = "auto",
    ) -> "VideoPipeline":
        """Start `workers` processes that each load `model` (a name in `weights/` or a local directory).

        Under `torchrun` (launcher "auto" or "torchrun") the pipeline instead joins the
        torchrun group: rank 0 returns the pipeline, the other ranks serve it and exit.
        """
        if parallel not in STRATEGIES:
            raise ValueError(f"parallel must be one of {', '.join(STRATEGIES)}; got {parallel!r}")
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (default: cuda when available); got {device!r}")
        parse_dtype(dtype)
        if cfg_parallel and workers % 2:
            raise ValueError(f"cfg_parallel needs an even number of workers, got workers={workers}")
        model_dir = str(resolve_latte(model))
        dtype_name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        pool = make_pool(workers, setup=runtime.setup_video_worker,
                         setup_args=(model_dir, parallel, dtype_name, cfg_parallel, attention), device=device,
                         launcher=launcher)
        try:
            info = pool.run(runtime.model_info)[0]
        except BaseException:
            pool.close()
            raise
        return cls(pool, model_dir, parallel, info)

    def set_parallel(self, parallel: str) -> None:
        """Switch the parallel strategy for later calls, without reloading the model."""
        if parallel not in STRATEGIES:
            raise ValueError(f"parallel must be one of {', '.join(STRATEGIES)}; got {parallel!r}")
        self.pool.run(runtime.set_strategy, parallel)
        # a restarted pool (after a worker crash) must come back with the same strategy
        model_dir, _, *rest = self.pool.setup_args
        self.pool.setup_args = (model_dir, parallel, *rest)
        self.parallel = self.info["strategy"] = parallel

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "VideoPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE downsampling x patch size)."""
        return self.info["vae_scale_factor"] * self.info["patch_size"]

    @property
    def default_size(self) -> int:
        return self.info["sample_size"] * self.info["vae_scale_factor"]

    # -- the call, diffusers style -----------------------------------------------------

    def check_inputs(self, prompt, negative_prompt, num_frames, height, width, num_inference_steps,
                     guidance_scale, seed, output_type, decode_chunk_size) -> list[str]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            raise ValueError(f"prompt must be a non-empty string or a non-empty list of strings; got {type(prompt).__name__}")
        if any(not p.strip() for p in prompts):
            raise ValueError("prompt must not be empty")
        if isinstance(negative_prompt, (list, tuple)):
            if len(negative_prompt) != len(prompts) or not all(isinstance(p, str) for p in negative_prompt):
                raise ValueError(f"negative_prompt must be a string or a list of {len(prompts)} strings (one per prompt)")
        elif not isinstance(negative_prompt, str):
            raise ValueError(f"negative_prompt must be a string or a list of strings; got {type(negative_prompt).__name__}")
        _check_int("num_frames", num_frames, 1, None)
        m = self.size_multiple
        for name, value in (("height", height), ("width", width)):
            _check_int(name, value, m, None)
            if value % m:
                raise ValueError(f"{name} must be a multiple of {m} (VAE factor x patch size); got {value}")
        _check_int("num_inference_steps", num_inference_steps, 1, MAX_STEPS)
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not 0 <= guidance_scale <= 100:
            raise ValueError(f"guidance_scale must be a number in [0, 100]; got {guidance_scale!r}")
        if seed is not None:
            _check_int("seed", seed, 0, 2**63 - 1)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}; got {output_type!r}")
        _check_int("decode_chunk_size", decode_chunk_size, 1, None)
        return prompts

    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] = "",
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        seed: int | None = None,
        output_type: str = "np",
        callback: Callable[[int, int], None] | None = None,
        decode_chunk_size: int = 8,
    ) -> VideoOutput:
        """Generate video(s). `callback(step, num_steps)` runs after every denoising step."""
        # 1. Check inputs
        num_frames = self.info["video_length"] if num_frames is None else num_frames
        height = self.default_size if height is None else height
        width = self.default_size if width is None else width
        prompts = self.check_inputs(prompt, negative_prompt, num_frames, height, width, num_inference_steps,
                                    guidance_scale, seed, output_type, decode_chunk_size)
        spec = runtime.GenerationSpec(
            request_id=uuid.uuid4().hex, prompt=prompts, negative_prompt=negative_prompt,
            num_frames=num_frames, height=height, width=width, num_inference_steps=num_inference_steps,
            guidance_scale=float(guidance_scale), seed=random.randrange(2**63) if seed is None else seed,
            decode_chunk_size=decode_chunk_size,
        )
        t_start = time.perf_counter()
        try:
            # 2. Encode the prompt and prepare latents (on the workers)
            admitted = self.pool.run(runtime.admit, spec)[0]
            # 3. Denoise, one parallel step at a time
            steps = admitted["steps"]
            for i in range(steps):
                self.pool.run(runtime.step, [spec.request_id])
                if callback is not None:
                    callback(i + 1, steps)
            # 4. Decode (frames split across workers)
            result = self.pool.run(runtime.decode, spec.request_id, output_type)[0]
        finally:
            if self.pool.ready:
                self.pool.run(runtime.release, [spec.request_id])
        wall = time.perf_counter() - t_start
        timings = dict(result["timings"], wall_s=wall)
        timings["overhead_s"] = wall - timings["encode_s"] - timings["transformer_s"] - timings["vae_s"]
        return VideoOutput(frames=result["video"], timings=timings)


def _check_int(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}; got {value}")

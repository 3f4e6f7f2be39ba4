"""`VideoPipeline`: text-to-video with any supported checkpoint, on a pool of parallel workers.

    from longserve.pipelines import VideoPipeline
    with VideoPipeline.from_pretrained("tiny-latte", workers=2) as pipe:      # parallel="auto": DSP here
        out = pipe("a red ball bouncing", num_frames=32, height=64, width=64,
                   num_inference_steps=20, guidance_scale=4.5, seed=0)
        out.save("ball.mp4", fps=8)

The checkpoint's `model_index.json` picks the model family (Latte, the Wan family, ...);
`workers=1` gives the frames the family's diffusers pipeline gives for the same
checkpoint, prompt, negative prompt and seed (`generator=torch.Generator("cpu").manual_seed(seed)`);
`workers=N` gives the frames `workers=1` gives. The pipeline submits to the engine
(`engine.engine.VideoEngine`, the same one the HTTP server talks to) and reads the
request's typed outputs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from longserve.engine.config import EngineConfig
from longserve.engine.engine import Accepted, VideoEngine
from longserve.engine.outputs import (
    Cancelled,
    Failed,
    Finished,
    FramesChunk,
    LiveChunkInfo,
    RequestOutput,
    Requeued,
    StepProgress,
)
from longserve.engine.pool import WorkerError
from longserve.engine.request import GenerationSpec, RequestError, RequestInput

OUTPUT_TYPES = ("np", "latent")
WHOLE_VIDEO = 1 << 30          # frames per decode call: everything that is final, split across the workers
#: what the pipeline changes of the engine's defaults: one caller, so decode whole and step 8 at a time
PIPELINE_DEFAULTS = {"decode_chunk_frames": WHOLE_VIDEO, "max_steps_per_job": 8}


@dataclass
class VideoOutput:
    """`frames`: float32 (B, T, H, W, 3) in [0, 1] for output_type "np"; latents (B, C, T, h, w) for "latent".
    `lora`: the LoRA adapters the video was made with, [{"name", "scale"}, ...]. `audio`: a model with sound
    (LTX-2): float32 samples (B, channels, n) in [-1, 1] at `audio_rate` Hz (for output_type "latent": the audio
    latents); None for a model without sound, or a request with `audio=False`."""

    frames: object
    timings: dict = field(default_factory=dict)
    lora: list = field(default_factory=list)
    audio: object = None
    audio_rate: int | None = None

    def save(self, path, fps: int = 8, index: int = 0) -> str:
        """Write video `index` of the batch as MP4 (H.264 through imageio-ffmpeg), with its sound as an AAC track
        when it has one."""
        save_video(self.frames[index], path, fps)
        if self.audio is not None and self.audio_rate:
            from longserve.pipelines.sound import as_sound, mux_audio

            mux_audio(path, path, as_sound(self.audio[index], self.audio_rate))
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


def raise_failure(out: Failed):
    """A failed request's error as the pipeline raises it: RequestError for the request's fault, else WorkerError."""
    e = out.error
    if e.kind == "input":
        raise RequestError(e.field or "request", e.message)
    raise WorkerError(e.message, kind=e.kind, rank=e.rank)


@dataclass
class LiveChunk:
    """One chunk of a live session: float32 frames (n, H, W, 3) in [0, 1]."""

    index: int
    frames: np.ndarray
    prompt_index: int          # which prompt made it: 0 the first, then one per switch() in order
    start: int                 # its first frame's index in the session


class LiveSession:
    """A running live session (`VideoPipeline.live`). Iterate for its chunks; `switch`, `stop`, `close`."""

    def __init__(self, handle, fps: int):
        self.handle, self.fps = handle, fps
        self.prompts = {0: handle.spec.prompt[0]}     # prompt index -> prompt (a replaced switch's left out)
        self.last_switch = None     # the engine's `PromptSwitch` of the last `switch` (its `by_chunk`: applied by then)
        self.timings: dict = {}

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def switch(self, prompt: str) -> int:
        """A new prompt from the next chunk on; returns its prompt index (what its chunks will carry). A switch
        sent before the previous one applied replaces it (that one's index never appears)."""
        switched = self.handle.switch(prompt)
        if switched is None:
            raise RuntimeError("the session has ended")
        self.prompts[switched.prompt_index] = prompt
        self.last_switch = switched
        if switched.replaced is not None:
            self.prompts.pop(switched.replaced, None)
        return switched.prompt_index

    def stop(self) -> None:
        """End after the chunk being made (the iteration delivers it, then ends)."""
        self.handle.stop()

    def close(self) -> None:
        """End now: the session's cache is freed at the next step boundary."""
        self.handle.cancel()

    def __iter__(self) -> Iterator[LiveChunk]:
        for out in self.handle:
            if isinstance(out, FramesChunk):
                live = out.live or LiveChunkInfo(0, 0)
                yield LiveChunk(live.chunk, out.frames[0], live.prompt_index, out.start)
            elif isinstance(out, Failed):
                raise_failure(out)
            elif isinstance(out, Finished):
                self.timings = dict(out.timings)

    def __enter__(self) -> "LiveSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VideoPipeline:
    """A text-to-video pipeline whose transformer runs sharded across `workers` processes."""

    def __init__(self, engine: VideoEngine):
        self.engine = engine

    @classmethod
    def from_pretrained(cls, model: str = "tiny-latte", **options) -> "VideoPipeline":
        """Start the workers that each load `model` (a name in `weights/` or a local directory).

        `options` are `engine.config.EngineConfig`'s fields, e.g. `workers=2`, `parallel="ulysses"`
        (or "auto": DSP for spatial-temporal models; Ulysses, or USP when the heads are fewer than
        the workers, for full-attention ones), `ulysses_degree`, `cfg_parallel`, `device`, `dtype`,
        `vae_tiling`, `max_steps_per_job`, `loras` (LoRA adapters loaded at start, chosen per call by name:
        `loras={"style": "style.safetensors", "fast": ("fast.safetensors", 0.8)}`, name -> path or (path,
        scale), as `load_lora_weights(path, adapter_name=name)` takes them; engine/lora.py). An unknown option
        is a ValueError naming it. Under
        `torchrun` the pipeline joins the torchrun group instead: rank 0 returns the pipeline, the
        other ranks serve it and exit.
        """
        return cls.from_config(EngineConfig.from_options(model=str(model), **{**PIPELINE_DEFAULTS, **options}))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "VideoPipeline":
        """The pipeline of an engine config built elsewhere (the CLI builds one from its flags)."""
        return cls(VideoEngine.start(config))

    @property
    def pool(self):
        return self.engine.pool

    @property
    def info(self):
        """The loaded model (`engine.config.ModelInfo`): family, plan, defaults, device, dtype, ..."""
        return self.engine.info

    @property
    def parallel(self) -> str:
        return self.engine.plan.name

    @property
    def defaults(self):
        """What a call that leaves an argument out gets: the model's defaults, with the engine's `default_steps`,
        `default_guidance_scale` and `default_fps` in their place where set (`VideoEngine.defaults`)."""
        return self.engine.defaults

    def set_parallel(self, parallel: str, ulysses_degree: int | None = None) -> None:
        """Switch the parallel plan for later calls, without reloading the model."""
        self.engine.set_plan(parallel, ulysses_degree)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "VideoPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the call, diffusers style -------------------------------------------------------------

    def request(self, prompt, negative_prompt="", num_frames=None, height=None, width=None,
                num_inference_steps=None, guidance_scale=None, seed=None, output_type="np", decode_chunk_size=8,
                lora=None, seconds=None, fps=None, live=False, **options) -> RequestInput:
        """A call's arguments as the engine's request: this door maps only its own syntax (`output_type`, a video
        given as an MP4 path); the engine completes the rest (`VideoEngine.complete`: defaults, seconds ->
        frames, checks)."""
        if output_type not in OUTPUT_TYPES:
            raise RequestError("output_type", f"output_type must be one of {', '.join(OUTPUT_TYPES)}; "
                                              f"got {output_type!r}")
        return RequestInput(prompt=prompt, negative_prompt=negative_prompt, num_frames=num_frames, seconds=seconds,
                            height=height, width=width, num_inference_steps=num_inference_steps,
                            guidance_scale=guidance_scale, seed=seed, fps=fps, output=output_type,
                            decode_chunk_size=decode_chunk_size, lora=lora, live=live,
                            options=self.read_inputs({k: v for k, v in options.items() if v is not None}))

    def accept(self, prompt, *args, **kwargs) -> Accepted:
        """A call's arguments, accepted by the engine (`request`, then `VideoEngine.accept`: completed and checked
        once); what `__call__`, `stream` and `live` submit."""
        return self.engine.accept(self.request(prompt, *args, **kwargs))

    def make_spec(self, prompt, *args, **kwargs) -> GenerationSpec:
        """The complete, checked request of a call's arguments (`accept(...).spec`)."""
        return self.accept(prompt, *args, **kwargs).spec

    @staticmethod
    def read_inputs(options: dict) -> dict:
        """`video="in.mp4"` (a path) -> its frames (`pipelines/media.py`); arrays and PIL images go as they are."""
        video = options.get("video")
        if isinstance(video, (str, os.PathLike)):
            from longserve.pipelines.media import read_mp4

            options = dict(options, video=read_mp4(video, "video"))
        return options

    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] = "",
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        output_type: str = "np",
        callback: Callable[[int, int], None] | None = None,
        decode_chunk_size: int = 8,
        seconds: float | None = None,
        fps: int | None = None,
        **options,
    ) -> VideoOutput:
        """Generate video(s). `callback(step, num_steps)` runs after every denoising step.

        `options` are the model family's own arguments (Wan 2.2: `guidance_scale_2`; the Wan family: `sigmas` or
        `timesteps`, a fixed schedule, as diffusers' `retrieve_timesteps` takes them; image-to-video: `image`, a PIL
        image or an (H, W, 3) array; diffusion forcing: `video`, the frames to extend, (T, H, W, 3) uint8, a list of
        PIL images or an MP4 path; ...) and `lora`, the adapters loaded at start to apply: `[{"name": "style",
        "scale": 0.8}]` or `{"style": 0.8}` (a RequestError names `lora` for an unknown one). `seconds` gives the
        length instead of `num_frames` (at `fps`; the nearest count the model makes; for an extension, the seconds
        added). Defaults for frames, size, steps, guidance and fps are the checkpoint's, or the engine's
        `default_*` options (`defaults`).
        """
        accepted = self.accept(prompt, negative_prompt, num_frames, height, width, num_inference_steps,
                               guidance_scale, seed, output_type, decode_chunk_size, seconds=seconds, fps=fps,
                               **options)
        t_start = time.perf_counter()
        chunks, timings, sound = [], {}, None
        for out in self._outputs(accepted, callback):
            if isinstance(out, FramesChunk):
                chunks.append(out.frames)
                sound = out.audio or sound
            elif isinstance(out, Requeued):
                chunks.clear()      # the workers restarted under it: it is made again, from the first frame
                sound = None
            elif isinstance(out, Finished):
                timings = out.timings
        if output_type == "latent":      # one piece, or a causal model's chunks (B, C, k, h, w) in order
            import torch

            video = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
        else:
            video = np.concatenate(chunks, axis=1)
        wall = time.perf_counter() - t_start
        timings = dict(timings, wall_s=wall)
        timings["overhead_s"] = wall - timings["encode_s"] - timings["transformer_s"] - timings["vae_s"]
        return VideoOutput(frames=video, timings=timings, lora=[dict(e) for e in accepted.spec.lora or []],
                           audio=None if sound is None else sound.samples,
                           audio_rate=None if sound is None or sound.latent else sound.rate)

    def stream(self, prompt: str | list, negative_prompt: str = "", num_frames: int | None = None,
               height: int | None = None, width: int | None = None, num_inference_steps: int | None = None,
               guidance_scale: float | None = None,
               seed: int | None = None, callback: Callable[[int, int], None] | None = None,
               decode_chunk_size: int = 8, timings: dict | None = None, seconds: float | None = None,
               fps: int | None = None, sound: dict | None = None, **options) -> Iterator[np.ndarray]:
        """Generate one video and yield its frames as soon as they are final: float32 (T_i, H, W, 3) in [0, 1].
        Pass a dict as `sound` to receive a model's sound ({"samples": (channels, n) float32, "rate": Hz}) with the
        last frames.

        The chunks concatenate to what `__call__` returns for the same arguments. A long
        video (diffusion forcing) yields each segment's frames while later segments are
        still being denoised; closing the generator early cancels the request. Pass a dict as
        `timings` to receive the request's timings once it is done.

        On a causal model (`causal_config.json`: Self-Forcing, LongLive) each yield is one chunk,
        and `prompt` may be a schedule `[(0, "a red ball bouncing"), (8, "a blue ball bouncing")]`:
        chunk index -> the prompt from that chunk on (a switch recaches the window, as LongLive does).
        """
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(e, (list, tuple)) for e in prompt):
            options["prompt_schedule"] = [list(e) for e in prompt]
            prompt = prompt[0][1] if len(prompt[0]) == 2 and isinstance(prompt[0][1], str) else ""
        if not isinstance(prompt, str):
            raise RequestError("prompt", "stream() takes one prompt (a string) or a schedule [(chunk, prompt), ...]")
        accepted = self.accept(prompt, negative_prompt, num_frames, height, width, num_inference_steps,
                               guidance_scale, seed, "np", decode_chunk_size, seconds=seconds, fps=fps, **options)
        yielded = 0      # frames handed out: after a worker restart the video is made again, the same frames
        for out in self._outputs(accepted, callback):
            if isinstance(out, FramesChunk) and out.stop > yielded:
                frames = out.frames[0][max(0, yielded - out.start):]
                yielded = out.stop
                if sound is not None and out.audio is not None:
                    sound.update(samples=out.audio.samples[0], rate=out.audio.rate)
                yield frames
            elif isinstance(out, Finished) and timings is not None:
                timings.update(out.timings)

    def live(self, prompt: str, seconds: float = 600.0, height: int | None = None, width: int | None = None,
             seed: int | None = None, fps: int | None = None, **options) -> "LiveSession":
        """Start a live session on a causal model: chunks of frames as they are made, `switch(prompt)` at any
        time (applied at the next chunk), `close()` (or leaving a `with` block) to end it. The session ends
        by itself after `seconds` of video (the frames of whole latent frames that fit). `image=` (a PIL image or
        an (H, W, 3) array) starts it from that image: held as clean context at the start of the cache."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 24 * 3600:
            raise RequestError("seconds", f"seconds must be in (0, 86400]; got {seconds!r}")
        handle = self.engine.submit(self.accept(prompt, "", None, height, width, None, None, seed, "np",
                                                seconds=seconds, fps=fps, live=True, **options))
        return LiveSession(handle, handle.spec.fps)

    def _outputs(self, accepted: Accepted, callback) -> Iterator[RequestOutput]:
        """The request's outputs; a failure raises (RequestError for the request's fault, else WorkerError)."""
        spec = accepted.spec
        handle = self.engine.submit(accepted)
        for out in handle:
            if isinstance(out, StepProgress) and callback is not None:
                callback(out.step, out.num_steps)
            elif isinstance(out, Failed):
                raise_failure(out)
            elif isinstance(out, Cancelled):
                raise RuntimeError(f"request {spec.request_id} was cancelled ({out.reason})")
            yield out

"""Long video by diffusion forcing (`SkyReelsV2DiffusionForcingPipeline` checkpoints), segment by segment.

A video of any length is made of overlapping segments of `base_num_frames`, each
conditioned on the last `overlap_history` frames of the one before; inside a segment every
latent frame has its own timestep (`ar_step` > 0: later blocks of `causal_block_size`
frames lag by `ar_step` steps) and attention is block-causal. The arguments and their
meaning are diffusers' (`SkyReelsV2DiffusionForcingPipeline.__call__`); the schedule is
diffusers' own `generate_timestep_matrix`. What differs is where things happen:

- every step of every segment is one parallel forward across all workers (the Wan
  family's plans: ulysses, ring, usp; cfg_parallel), with the block-causal mask and the
  per-frame timesteps applied to each rank's tokens by their global positions;
- the request is one long sequence of steps for the engine's scheduler (so it batches,
  reports progress per step, cancels at the next step of whatever segment runs);
- when a segment is done, its new latent frames are final: the scheduler decodes them
  (the causal VAE carries its cache from segment to segment, so the frames equal one
  decode at the end) and hands them out, while later segments denoise. A worker keeps
  only the current segment, the last `overlap_history` latent frames and the VAE's cache:
  memory does not grow with `num_frames`.

Conditioning on an image or a video (diffusers' `SkyReelsV2DiffusionForcingImageToVideoPipeline` and
`SkyReelsV2DiffusionForcingVideoToVideoPipeline`, which load the same checkpoints: one set of weights does
all three): the condition is a prefix of clean latent frames that the first segment starts from, exactly as
every later segment starts from the end of the one before. An image is VAE-encoded into one latent frame
(the video's first); a video's last `overlap_history` frames are VAE-encoded into the prefix (cut to whole
causal blocks) and the new segments continue it. Both are encoded on rank 0 by the pipelines' own
`prepare_latents` and broadcast with the prompt. The content of an extension is the whole extended video:
the input's frames (at the request's size, as diffusers' `preprocess_video` resizes them), handed out first,
then the new frames. diffusers' V2V output is the input followed by every frame it decodes, the first
`overlap_history` of which re-make the input's last ones; those are dropped here (a repeat of the input's
end is not a continuation), so an extension equals diffusers' output without them and grows by
`num_frames - overlap_history` frames.

Exactness: with `addnoise_condition` > 0 diffusers draws the conditioning noise from
torch's global RNG; here it comes from a generator seeded from the request's seed (so
every rank draws the same), hence frames equal diffusers' for addnoise_condition=0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from longserve.engine import timeline
from longserve.engine.config import ModelDescription
from longserve.engine.decoding import FramesPolicy, decoded_frames, to_pixels
from longserve.engine.families.base import cfg_rows, check_common, check_int, check_number, read_json, seeded_generator
from longserve.engine.families.wan import WanFacts, WanFamily, WanRequest
from longserve.engine.families.wan_parts import MAX_SEQUENCE_LENGTH
from longserve.engine.images import as_rgb_array, as_video_array, to_pil, video_frames
from longserve.engine.request import GenerationSpec, RequestError

DF_OPTIONS = ("base_num_frames", "overlap_history", "ar_step", "causal_block_size", "addnoise_condition", "fps",
              "image", "video", "last_image", timeline.OPTION)
T2V, I2V, V2V = ("SkyReelsV2DiffusionForcingPipeline", "SkyReelsV2DiffusionForcingImageToVideoPipeline",
                 "SkyReelsV2DiffusionForcingVideoToVideoPipeline")
#: what a checkpoint takes, by the class its model_index.json names. The published DF checkpoints name the
#: text-to-video class and diffusers' own examples load them into all three pipelines, so they take an image, a
#: video or neither; a directory saved from the I2V or V2V pipeline is served as that pipeline serves it.
INPUTS = {T2V: {"image": "optional", "video": "optional"},
          I2V: {"image": "required", "video": "refused"},
          V2V: {"image": "refused", "video": "required"}}


def segment_plan(num_frames: int, base_num_frames: int, overlap_history: int | None, causal_block_size: int,
                 temporal: int, condition: str = "text") -> dict:
    """Latent frames per segment, as the diffusers pipelines lay them out.

    condition: "text"; "image" (the first segment starts from the image's latent frame: DF-I2V); "video" (every
    segment, the first too, starts from `overlap_history` frames of what came before: DF-V2V, always laid out as
    a long video, its first segment after the input video's end).
    -> {"long": bool, "overlap": latent frames carried over, "segments": [(latent frames, prefix frames)]}
    """
    num_latent = (num_frames - 1) // temporal + 1
    first_prefix = 1 if condition == "image" else 0
    long = condition == "video" or (overlap_history is not None and num_frames > base_num_frames)
    if not long:
        return {"long": False, "overlap": 0, "segments": [(num_latent, first_prefix)]}
    overlap = (overlap_history - 1) // temporal + 1
    base = (base_num_frames - 1) // temporal + 1
    n_iter = 1 + (num_latent - base - 1) // (base - overlap) + 1
    prefix = overlap - overlap % causal_block_size           # the prefix is cut to whole causal blocks
    segments = [] if condition == "video" else [(base, first_prefix)]
    for i in range(len(segments), n_iter):
        finished = i * (base - overlap) + overlap
        segments.append((min(num_latent - finished + overlap, base), prefix))
    return {"long": True, "overlap": overlap, "segments": segments}


def segment_frame_starts(num_frames: int, base_num_frames: int, overlap_history: int | None,
                         causal_block_size: int = 1, temporal: int = 1) -> list[int]:
    """The first new (video) frame of each segment: where a segment's frames start in the finished video."""
    plan = segment_plan(num_frames, base_num_frames, overlap_history, causal_block_size, temporal)
    starts, latent = [], 0
    for i, (frames, _) in enumerate(plan["segments"]):
        starts.append(0 if latent == 0 else 1 + (latent - 1) * temporal)
        latent += frames - (plan["overlap"] if i else 0)
    return starts


def check_schedule(desc: ModelDescription, steps: int, plan: dict, ar_step: int, cbs: int) -> None:
    """Build every segment's schedule with diffusers' own `generate_timestep_matrix`, as the pipeline
    would, so a schedule diffusers refuses (its minimum `ar_step`) is refused here, naming ar_step."""
    import diffusers

    config = desc.facts.scheduler_config
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    scheduler.set_timesteps(steps)
    for frames, prefix in plan["segments"]:
        try:
            diffusers.SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
                None, frames, scheduler.timesteps, frames, ar_step, prefix, cbs)
        except ValueError as e:
            raise RequestError("ar_step", f"ar_step={ar_step}: {e}") from None


@dataclass(frozen=True)
class DFFacts(WanFacts):
    frames_per_block: int = 1             # the transformer's causal block (the default causal_block_size)


@dataclass
class DFRequest(WanRequest):
    plan: dict = None
    cbs: int = 1
    fps_id: int = 1
    addnoise: float = 0.0
    generator: torch.Generator = None                # draws every segment's noise, in order (as diffusers)
    noise_generator: torch.Generator = None          # draws addnoise_condition's noise
    matrices: list = field(default_factory=list)     # per segment: (step_matrix, update_mask, valid_interval)
    segment: int = 0
    row: int = 0                                      # row of the current segment's step matrix
    schedulers: list = field(default_factory=list)    # one per latent frame of the current segment
    tail: torch.Tensor = None                         # the last `overlap` final latent frames (the next prefix)
    condition: torch.Tensor = None                    # the first segment's prefix (B, C, k, h, w): image or video
    texts: list = None                                # a prompt timeline: each distinct prompt's rows, like `text`
    segment_prompts: list = None                      # ... and per segment, which of them it is conditioned on


class SkyReelsDiffusionForcingFamily(WanFamily):
    """`SkyReelsV2DiffusionForcing*Pipeline` checkpoints: long video by diffusion forcing, from text, an image or
    the end of a video."""

    name = "skyreels-df"
    _t2v = {"height": 544, "width": 960, "num_frames": 97, "num_inference_steps": 50, "guidance_scale": 6.0, "fps": 24,
            "base_num_frames": 97, "overlap_history": None, "ar_step": 0, "causal_block_size": None,
            "addnoise_condition": 0}
    #: diffusers' `__call__` defaults per class; V2V's num_frames=120 is what diffusers rounds to 4k+1 (121)
    pipeline_defaults = {T2V: _t2v, I2V: {**_t2v, "guidance_scale": 5.0}, V2V: {**_t2v, "num_frames": 121}}
    pipeline_classes = frozenset(pipeline_defaults)

    @classmethod
    def describe(cls, model_dir) -> ModelDescription:
        desc = super().describe(model_dir)
        cfg = read_json(Path(model_dir) / "transformer" / "config.json")
        inputs = INPUTS[desc.pipeline]
        return replace(desc, family=cls.name, options=DF_OPTIONS,
                       capabilities=cls.capabilities(DF_OPTIONS, image=inputs["image"], video=inputs["video"],
                                                     long_video=True),
                       facts=DFFacts(**vars(desc.facts), frames_per_block=cfg.get("num_frame_per_block", 1)))

    @classmethod
    def check_conditions(cls, desc: ModelDescription, spec: GenerationSpec) -> tuple[str, dict]:
        """The request's image or video, as the checkpoint's class takes them -> (condition, options)."""
        options = {k: v for k, v in spec.options.items() if not (k in ("image", "video", "last_image") and v is None)}
        if "last_image" in options:
            raise RequestError("last_image", "last_image is not supported by diffusion forcing: diffusers' DF "
                                             "image-to-video appends it to the last segment only, and trims the "
                                             "video by that segment's prefix rather than by the image")
        if "image" in options and "video" in options:
            raise RequestError("video", "give an image (a video from its first frame) or a video (to extend), "
                                        "not both")
        rules = {"image": desc.capabilities.image, "video": desc.capabilities.video}
        for name, other in (("image", "a video to extend"), ("video", "an image to start from")):
            if rules[name] == "refused" and name in options:
                raise RequestError(name, f"{name} is not taken by this {desc.pipeline} checkpoint: it needs {other}")
        for name, what in (("image", "an image to start from"), ("video", "a video to extend")):
            if rules[name] == "required" and name not in options:
                raise RequestError(name, f"{name} is required: this {desc.pipeline} checkpoint needs {what}")
        if "image" in options:
            options["image"] = as_rgb_array(options["image"], "image")
            return "image", options
        if "video" in options:
            options["video"] = as_video_array(options["video"], "video")
            return "video", options
        return "text", options

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        """diffusers' rules for the long-video arguments, naming the field; fills in their defaults (and a prompt
        timeline's: engine/timeline.py)."""
        spec = timeline.check_timeline(spec, spec.fps or desc.defaults.fps)
        check_common(desc, spec)
        condition, options = cls.check_conditions(desc, spec)
        o, d = options, desc.defaults.options
        base = o.get("base_num_frames", d.get("base_num_frames", 97))
        overlap = o.get("overlap_history", d.get("overlap_history"))
        ar_step = o.get("ar_step", d.get("ar_step", 0))
        cbs = o.get("causal_block_size", d.get("causal_block_size")) or desc.facts.frames_per_block
        check_int("base_num_frames", base, 1)
        if overlap is not None:
            check_int("overlap_history", overlap, 1)
        check_int("ar_step", ar_step, 0)
        check_int("causal_block_size", cbs, 1)
        check_number("addnoise_condition", o.get("addnoise_condition", d.get("addnoise_condition", 0)), 0, 1000)
        check_int("fps", o.get("fps", desc.defaults.fps), 1, 1000)
        temporal = desc.frame_multiple
        if spec.num_frames > base and overlap is None:
            raise RequestError("overlap_history", f"num_frames ({spec.num_frames}) exceeds base_num_frames ({base}): "
                                                  f"a long video needs overlap_history (17 or 37 are recommended)")
        if overlap is not None and (overlap - 1) // temporal >= (base - 1) // temporal:
            raise RequestError("overlap_history", f"overlap_history ({overlap}) must be shorter than "
                                                  f"base_num_frames ({base}) by at least {temporal} frames")
        if condition == "video":
            cls.check_extension(spec, o["video"], overlap, temporal)
        plan = segment_plan(spec.num_frames, base, overlap, cbs, temporal, condition)
        for frames, _ in plan["segments"]:
            if frames % cbs:
                raise RequestError("causal_block_size", f"causal_block_size ({cbs}) must divide the latent frames of "
                                                        f"every segment; this video's segments have "
                                                        f"{[f for f, _ in plan['segments']]}")
        check_schedule(desc, spec.num_inference_steps, plan, ar_step, cbs)
        options = {**{k: v for k, v in (("base_num_frames", base), ("overlap_history", overlap),
                                        ("ar_step", ar_step), ("causal_block_size", cbs)) if v is not None},
                   **options}
        return replace(spec, options=options)

    @staticmethod
    def check_extension(spec: GenerationSpec, video, overlap: int | None, temporal: int) -> None:
        """A video to extend: the model re-makes its last `overlap_history` frames and goes on from there."""
        if overlap is None:
            raise RequestError("overlap_history", "extending a video needs overlap_history: the frames of its end "
                                                  "that the continuation is conditioned on (17 or 37 are recommended)")
        if (overlap - 1) % temporal:
            lower = (overlap - 1) // temporal * temporal + 1
            raise RequestError("overlap_history", f"overlap_history must be {temporal}k+1 to extend a video (its "
                                                  f"encoded frames then end with the video's last frame); got "
                                                  f"{overlap}, try {lower} or {lower + temporal}")
        if len(video) < overlap:
            raise RequestError("video", f"the video has {len(video)} frames; extending it needs at least "
                                        f"overlap_history ({overlap})")
        if spec.num_frames <= overlap:
            raise RequestError("num_frames", f"num_frames ({spec.num_frames}) must exceed overlap_history "
                                             f"({overlap}): the model re-makes the video's last overlap_history "
                                             f"frames, then continues; the video grows by num_frames - "
                                             f"overlap_history frames")

    @classmethod
    def content_frames(cls, desc: ModelDescription, spec: GenerationSpec) -> int:
        """Frames handed out for a checked request: an extension's are the input's and the new ones."""
        video = spec.options.get("video")
        if video is None or spec.output == "latent":
            return spec.num_frames
        return len(video) + spec.num_frames - spec.options["overlap_history"]

    # -- worker side --------------------------------------------------------------------------------

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        #: rank 0: an extension's video as `encode_conditions` decoded it (a door keeps it as its MP4), until
        #: `prepare` of the same admission takes it for the lead frames it hands out
        self._decoded: dict[str, object] = {}

    @staticmethod
    def condition_of(spec: GenerationSpec) -> str:
        return "image" if spec.options.get("image") is not None else \
            "video" if spec.options.get("video") is not None else "text"

    def conditioning_pipeline(self, pipeline_class: str):
        """Rank 0: diffusers' I2V or V2V pipeline over this worker's loaded components (no copy), for its own
        `prepare_latents`."""
        import diffusers

        cache = self.__dict__.setdefault("_conditioning", {})
        if pipeline_class not in cache:
            cache[pipeline_class] = getattr(diffusers, pipeline_class)(
                **{k: getattr(self.pipe, k) for k in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")})
        return cache[pipeline_class]

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the first segment's prefix latents (B, C, k, h, w), by the DF-I2V / DF-V2V pipelines' own
        `prepare_latents`: the image VAE-encoded (k = 1), or the video's last `overlap_history` frames (k: their
        latent frames, cut to whole causal blocks)."""
        texts = timeline.encode_other_prompts(self.pipe, spec, self.pg.device, MAX_SEQUENCE_LENGTH)
        condition = self.condition_of(spec)
        if condition == "text":
            return texts
        o, device, B = spec.options, self.pg.device, spec.batch_size
        z, temporal = self.pipe.vae.config.z_dim, self.vae_temporal
        if condition == "image":
            pipe = self.conditioning_pipeline(I2V)
            pixels = pipe.video_processor.preprocess(to_pil(o["image"]), height=spec.height, width=spec.width)
            placeholder = torch.zeros(self.latent_shape(spec, 1), device=device)     # our noise is drawn later
            _, _, prefix, _ = pipe.prepare_latents(pixels.to(device, dtype=torch.float32), B, z, spec.height,
                                                   spec.width, spec.num_frames, torch.float32, device, None,
                                                   placeholder)
        else:
            pipe = self.conditioning_pipeline(V2V)
            overlap = o["overlap_history"]
            # only the frames the VAE encodes: the preprocessing is per frame, so this is the tail of diffusers'
            frames = video_frames(o["video"])              # a door's MP4 is decoded here, on rank 0
            tail = pipe.video_processor.preprocess_video([to_pil(f) for f in frames[-overlap:]],
                                                         height=spec.height, width=spec.width)  # (1, 3, overlap, H, W)
            # it also draws a first segment's noise: from a throwaway generator (ours is drawn by every rank)
            _, _, prefix, _ = pipe.prepare_latents(
                tail.to(device, dtype=torch.float32), B, z, spec.height, spec.width, spec.num_frames, torch.float32,
                device, torch.Generator("cpu").manual_seed(0), None,
                base_latent_num_frames=(o["base_num_frames"] - 1) // temporal + 1, overlap_history=overlap,
                causal_block_size=o["causal_block_size"], overlap_history_latent_frames=(overlap - 1) // temporal + 1,
                long_video_iter=0)
            if self.pg.rank == 0 and frames is not o["video"]:
                # its lead frames, handed out by rank 0 (prepare); kept only once the encode has succeeded (a
                # failure here fails the request in admit, and nothing would ever take them)
                self._decoded[spec.request_id] = frames
        return {**texts, "condition": prefix.expand(B, -1, -1, -1, -1).contiguous()}       # (B, C, k, h, w)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, condition: torch.Tensor = None,
                prompt_texts: torch.Tensor = None) -> DFRequest:
        o, d = spec.options, self.desc.defaults
        decoded = self._decoded.pop(spec.request_id, None)          # rank 0: the video encode_conditions decoded
        cbs = o["causal_block_size"]
        kind = self.condition_of(spec)
        plan = segment_plan(spec.num_frames, o["base_num_frames"], o.get("overlap_history"), cbs, self.vae_temporal,
                            kind)
        if condition is not None:
            # the first prefix is what the VAE made of the image or the video's end, as diffusers counts it: the
            # Wan encoder takes 1 + 4j frames, so a VAE that does not compress time (tiny-skyreels-df's) encodes
            # 1 + 4 * ((overlap_history - 1) // 4) of the last overlap_history frames
            plan["segments"][0] = (plan["segments"][0][0], condition.shape[2])
        timesteps = self.new_scheduler(spec.num_inference_steps).timesteps
        matrices = []
        for frames, prefix in plan["segments"]:
            # diffusers' DF-I2V passes base_num_frames here for every segment, and so fails (an IndexError) on a
            # last segment shorter than the others; T2V and V2V pass the segment's frames, as done here for all
            step_matrix, _, update_mask, interval = self.pipe.generate_timestep_matrix(
                frames, timesteps, frames, o["ar_step"], prefix, cbs)
            matrices.append((step_matrix, update_mask, interval))
        fps = o.get("fps", d.fps)
        num_frames, policy, lead_frames = self.content_frames(self.desc, spec), FramesPolicy(self.vae_temporal), None
        if kind == "video":
            video, spec = o["video"], replace(spec, options={k: v for k, v in o.items() if k != "video"})
            if spec.output != "latent":             # "latent" is diffusers' own: the new latents, prefix included
                # the input's frames first; the decoded frames that re-make its end are not handed out
                policy = FramesPolicy(self.vae_temporal, lead=len(video),
                                      skip=decoded_frames(plan["overlap"], self.vae_temporal))
                if self.pg.rank == 0:                # rank 0 alone hands them out; the others drop theirs
                    lead_frames = functools.partial(self.input_frames, video if decoded is None else decoded, spec)
        req = DFRequest(spec=spec, num_steps=sum(len(m[0]) for m in matrices), batch_key=(),
                        num_frames=num_frames, text=text, plan=plan, cbs=cbs, fps_id=0 if fps == 16 else 1,
                        addnoise=float(o.get("addnoise_condition", d.options.get("addnoise_condition", 0))),
                        generator=seeded_generator(spec.seed), noise_generator=seeded_generator(spec.seed + 1),
                        matrices=matrices, condition=condition,
                        frames=self.frame_stream(spec, num_frames, policy, lead_frames))
        self.prompt_segments(req, prompt_texts)
        self._start_segment(req)
        return req

    def prompt_segments(self, r: DFRequest, texts: torch.Tensor | None) -> None:
        """The request's prompt rows per distinct prompt ([negative; positive] under CFG, as `text`) and which one
        each segment takes: the prompt of its first new frame's time (engine/timeline.py)."""
        starts, latent = [], 0
        for i, (frames, _) in enumerate(r.plan["segments"]):
            starts.append(decoded_frames(latent, self.vae_temporal))
            latent += frames - (r.plan["overlap"] if i else 0)
        r.segment_prompts = timeline.segment_prompts(r.spec, starts, r.spec.fps or self.desc.defaults.fps)
        r.texts = timeline.prompt_rows(r.text, texts, r.spec.use_cfg)

    def input_frames(self, video, spec: GenerationSpec, start: int, stop: int):
        """Rank 0: frames [start, stop) of the video an extension continues, at the request's size as diffusers'
        `preprocess_video` resizes them: (B, n, H, W, 3)."""
        pixels = self.pipe.video_processor.preprocess_video([to_pil(f) for f in video[start:stop]],
                                                            height=spec.height, width=spec.width)
        return to_pixels(pixels.expand(spec.batch_size, -1, -1, -1, -1), self.pipe.video_processor, spec.output)

    def _start_segment(self, r: DFRequest) -> None:
        """Draw the segment's noise (the request's generator, in order, as diffusers), put the prefix in: the end
        of the segment before, or for the first, the image's or the video's latent frames."""
        frames, prefix = r.plan["segments"][r.segment]
        r.text = r.texts[r.segment_prompts[r.segment]]
        latents = torch.randn(self.latent_shape(r.spec, frames), generator=r.generator,
                              dtype=torch.float32).to(self.pg.device)
        if prefix and r.segment == 0:
            latents[:, :, :prefix] = r.condition[:, :, :prefix].to(self.dtype)
            r.condition = None
        elif prefix:
            latents[:, :, :prefix] = r.tail[:, :, -r.plan["overlap"]:][:, :, :prefix].to(self.dtype)
        r.latents, r.row = latents, 0
        r.schedulers = [self.new_scheduler(r.spec.num_inference_steps) for _ in range(frames)]
        r.batch_key = self.batch_key(r)

    def batch_key(self, r: DFRequest) -> tuple:
        if r.steps_done >= r.num_steps:
            return ("skyreels-df", "done")
        s, e = r.matrices[r.segment][2][r.row]
        B, C, _, h, w = r.latents.shape
        # one fps per batch: diffusers' forward adds one fps embedding to every row (engine/models/wan.py)
        return ("skyreels-df", B, C, e - s, h, w, r.cbs, r.fps_id)

    def model_for(self, reqs: list[DFRequest]):
        return functools.partial(self.experts[0], frames_per_block=reqs[0].cbs, fps=reqs[0].fps_id)

    def cache_scope(self, reqs: list[DFRequest]) -> int:
        return 0                # one denoiser (its requests carry no expert timesteps)

    def inputs(self, r: DFRequest) -> dict:
        step_matrix, _, interval = r.matrices[r.segment]
        s, e = interval[r.row]
        t = step_matrix[r.row]
        x = r.latents[:, :, s:e].to(self.dtype).clone()                            # (B, C, e-s, h, w)
        timestep = t.expand(x.shape[0], -1)[:, s:e].clone()                         # (B, e-s)
        prefix = r.plan["segments"][r.segment][1]
        if r.addnoise > 0 and s < prefix:
            factor = 0.001 * r.addnoise
            noise = torch.randn(x[:, :, :prefix - s].shape, generator=r.noise_generator).to(x)
            x[:, :, :prefix - s] = x[:, :, :prefix - s] * (1.0 - factor) + noise * factor
            timestep[:, :prefix - s] = r.addnoise
        x, timestep = cfg_rows(r, x), cfg_rows(r, timestep)
        return {"x": x, "t": timestep, "text": r.text}

    def guidance_scale(self, r: DFRequest) -> float:
        return r.spec.guidance_scale

    def advance(self, r: DFRequest, pred: torch.Tensor) -> None:
        """Scheduler steps for the frames this row updates; at a segment's end its new frames become final."""
        step_matrix, update_mask, interval = r.matrices[r.segment]
        s, e = interval[r.row]
        t = step_matrix[r.row]
        for idx in range(s, e):
            if update_mask[r.row][idx].item():
                r.latents[:, :, idx] = r.schedulers[idx].step(pred[:, :, idx - s], t[idx], r.latents[:, :, idx],
                                                              return_dict=False)[0]
        r.row += 1
        r.steps_done += 1
        if r.row == len(step_matrix):
            self._finish_segment(r)
        r.batch_key = self.batch_key(r)

    def _finish_segment(self, r: DFRequest) -> None:
        overlap = r.plan["overlap"]
        new = r.latents if r.segment == 0 else r.latents[:, :, overlap:]           # (B, C, k, h, w) final
        if r.plan["long"]:
            r.tail = new[:, :, -overlap:] if r.tail is None else torch.cat([r.tail, new], dim=2)[:, :, -overlap:]
        r.frames.push(new, last=r.segment == len(r.plan["segments"]) - 1)
        r.segment += 1
        r.schedulers = []
        if r.segment < len(r.plan["segments"]):
            self._start_segment(r)
        else:
            r.latents = r.tail = None


FAMILY = SkyReelsDiffusionForcingFamily

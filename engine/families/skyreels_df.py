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

Exactness: with `addnoise_condition` > 0 diffusers draws the conditioning noise from
torch's global RNG; here it comes from a generator seeded from the request's seed (so
every rank draws the same), hence frames equal diffusers' for addnoise_condition=0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import ModelDescription
from engine.families.base import cfg_rows, check_common, check_int, check_number, read_json, seeded_generator
from engine.families.wan import WanFamily, WanRequest
from engine.request import GenerationSpec, RequestError

DF_OPTIONS = ("base_num_frames", "overlap_history", "ar_step", "causal_block_size", "addnoise_condition", "fps")


def segment_plan(num_frames: int, base_num_frames: int, overlap_history: int | None, causal_block_size: int,
                 temporal: int) -> dict:
    """Latent frames per segment, as the diffusers pipeline lays them out.

    -> {"long": bool, "overlap": latent frames carried over, "segments": [(latent frames, prefix frames)]}
    """
    num_latent = (num_frames - 1) // temporal + 1
    long = overlap_history is not None and num_frames > base_num_frames
    if not long:
        return {"long": False, "overlap": 0, "segments": [(num_latent, 0)]}
    overlap = (overlap_history - 1) // temporal + 1
    base = (base_num_frames - 1) // temporal + 1
    n_iter = 1 + (num_latent - base - 1) // (base - overlap) + 1
    prefix = overlap - overlap % causal_block_size           # the prefix is cut to whole causal blocks
    segments = [(base, 0)]
    for i in range(1, n_iter):
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

    scheduler = getattr(diffusers, desc.extra["scheduler_class"]).from_config(desc.extra["scheduler_config"])
    scheduler.set_timesteps(steps)
    for frames, prefix in plan["segments"]:
        try:
            diffusers.SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
                None, frames, scheduler.timesteps, frames, ar_step, prefix, cbs)
        except ValueError as e:
            raise RequestError("ar_step", f"ar_step={ar_step}: {e}") from None


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
    outputs: list = field(default_factory=list)       # output_type "latent": the final latents, kept


class SkyReelsDiffusionForcingFamily(WanFamily):
    """`SkyReelsV2DiffusionForcingPipeline` checkpoints: long video by diffusion forcing."""

    name = "skyreels-df"
    pipeline_defaults = {"SkyReelsV2DiffusionForcingPipeline": {
        "height": 544, "width": 960, "num_frames": 97, "num_inference_steps": 50, "guidance_scale": 6.0, "fps": 24,
        "base_num_frames": 97, "overlap_history": None, "ar_step": 0, "causal_block_size": None,
        "addnoise_condition": 0}}
    pipeline_classes = frozenset(pipeline_defaults)

    @classmethod
    def describe(cls, model_dir) -> ModelDescription:
        desc = super().describe(model_dir)
        cfg = read_json(Path(model_dir) / "transformer" / "config.json")
        scheduler = read_json(Path(model_dir) / "scheduler" / "scheduler_config.json")
        return replace(desc, family=cls.name, options=DF_OPTIONS, long_video=True,
                       extra={**desc.extra, "frames_per_block": cfg.get("num_frame_per_block", 1),
                              "scheduler_class": scheduler["_class_name"], "scheduler_config": scheduler})

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        """diffusers' rules for the long-video arguments, naming the field; fills in their defaults."""
        check_common(desc, spec)
        o, d = spec.options, desc.defaults.options
        base = o.get("base_num_frames", d.get("base_num_frames", 97))
        overlap = o.get("overlap_history", d.get("overlap_history"))
        ar_step = o.get("ar_step", d.get("ar_step", 0))
        cbs = o.get("causal_block_size", d.get("causal_block_size")) or desc.extra["frames_per_block"]
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
        plan = segment_plan(spec.num_frames, base, overlap, cbs, temporal)
        for frames, _ in plan["segments"]:
            if frames % cbs:
                raise RequestError("causal_block_size", f"causal_block_size ({cbs}) must divide the latent frames of "
                                                        f"every segment; this video's segments have "
                                                        f"{[f for f, _ in plan['segments']]}")
        check_schedule(desc, spec.num_inference_steps, plan, ar_step, cbs)
        spec.options = {**{k: v for k, v in (("base_num_frames", base), ("overlap_history", overlap),
                                             ("ar_step", ar_step), ("causal_block_size", cbs)) if v is not None},
                        **spec.options}
        return spec

    # -- worker side --------------------------------------------------------------------------------

    def prepare(self, spec: GenerationSpec, text: torch.Tensor) -> DFRequest:
        o, d = spec.options, self.desc.defaults
        cbs = o["causal_block_size"]
        plan = segment_plan(spec.num_frames, o["base_num_frames"], o.get("overlap_history"), cbs, self.vae_temporal)
        timesteps = self.new_scheduler(spec.num_inference_steps).timesteps
        matrices = []
        for frames, prefix in plan["segments"]:
            step_matrix, _, update_mask, interval = self.pipe.generate_timestep_matrix(
                frames, timesteps, frames, o["ar_step"], prefix, cbs)
            matrices.append((step_matrix, update_mask, interval))
        fps = o.get("fps", d.fps)
        req = DFRequest(spec=spec, num_steps=sum(len(m[0]) for m in matrices), batch_key=(),
                        num_frames=spec.num_frames, text=text, plan=plan, cbs=cbs, fps_id=0 if fps == 16 else 1,
                        addnoise=float(o.get("addnoise_condition", d.options.get("addnoise_condition", 0))),
                        generator=seeded_generator(spec.seed), noise_generator=seeded_generator(spec.seed + 1),
                        matrices=matrices)
        self._start_segment(req)
        return req

    def _start_segment(self, r: DFRequest) -> None:
        """Draw the segment's noise (the request's generator, in order, as diffusers), put the prefix in."""
        frames, prefix = r.plan["segments"][r.segment]
        latents = torch.randn(self.latent_shape(r.spec, frames), generator=r.generator,
                              dtype=torch.float32).to(self.pg.device)
        if prefix:
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
        if r.spec.output == "latent":
            r.outputs.append(new)                # the caller asked for every latent: held until the end
            if r.segment == len(r.plan["segments"]) - 1:
                r.pending = torch.cat(r.outputs, dim=2)
        else:
            r.pending = new if r.pending is None else torch.cat([r.pending, new], dim=2)
        r.segment += 1
        r.schedulers = []
        if r.segment < len(r.plan["segments"]):
            self._start_segment(r)
        else:
            r.latents = r.tail = None

    def final_latents(self, r: DFRequest) -> torch.Tensor:
        latents, r.pending, r.outputs = r.pending, None, []
        return latents


FAMILY = SkyReelsDiffusionForcingFamily

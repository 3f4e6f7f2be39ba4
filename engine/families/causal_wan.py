"""Causal few-step Wan models (Self-Forcing, LongLive, CausVid kind): live and finite video, chunk by chunk.

A checkpoint of this family is a directory with `causal_config.json` (weights/causal_wan.py
describes it; the released generator file is loaded as it is). A request is a loop of
chunks; each chunk is `steps_per_chunk` engine steps, so chunks of different requests share
batched forwards (any phase: a row's timestep, prompt and cache are its own):

    step 0..n-1   denoise the chunk: v = model(x, t_i) over [cache | chunk]; x0 = x - sigma_i v;
                  x = (1 - sigma_{i+1}) x0 + sigma_{i+1} noise (fresh, from the request's generator)
    after n-1     the chunk (x0) is final: queued for decoding, decoded at the next boundary
    step n        the context pass: model(x0, context_noise) writes the chunk's K/V into the cache
                  (skipped after the last chunk); then the next chunk starts from fresh noise

Inside the loop nothing waits for the device: a chunk's noises (its start and each step's) are drawn
at its start from the request's CPU generator (the same video from a seed on any device) into one
pinned buffer and moved without a sync; timesteps are made on the device; RoPE rows are built there
(engine/models/causal.py); the device is waited for only in bench's timing mode (`TIMED_STAGES_ENV`).

Prompts: a request starts with prompt index 0. `options["prompt_schedule"]` ([[chunk, prompt],
...], the first at chunk 0) switches at the listed chunks; `update(prompt=..., prompt_index=...)`
(the scheduler numbers and holds switches, one per request, until `switch_ready`: a chunk's start
with no switch applied in it yet) applies a prompt at once, or at the next chunk boundary when
it comes mid-chunk (a newer one replaces it then). The texts kept are the current prompt's and
the schedule's still to come: a session's prompt history is bounded, however many switches it had.
A switch recomputes the cached frames' K/V under the
new prompt (LongLive's recache: context passes over the cached clean latents, oldest first)
and the text K/V. Every decoded chunk says which chunk it is and which prompt made it
(`FramesChunk.live`), so a switch is observable exactly. `update(stop=True)` ends a request
after the chunk it is making; `GenerationSpec.live` marks a session (its length, `num_frames`, is
then the front door's limit).

From an image (`options["image"]`, as Self-Forcing / CausVid inference takes an initial latent): rank 0 VAE-encodes
it into one latent frame (normalised as Wan's image-to-video pipeline does), and every rank writes it into the cache
as clean context before the first chunk (one context pass): frame 0 of the cache, the sink when the model keeps one,
and the first frame a recache replays. And it is the video's first frame, as Self-Forcing's inference returns
[initial latent | generated latents] decoded together (and Wan's image-to-video pipelines begin with the image): its
latent frame is pushed to the frame stream in front of chunk 0's, so the same streaming VAE decode carries its causal
cache into chunk 0, exactly as decoding the whole video would. So, from an image:

- `num_frames` is still the video's length, the image's frame included (as Wan's I2V counts it): the chunks make
  latent frames 1.. (`lead` = 1), one fewer than without an image, and the last chunk is cut to fit;
- chunk 0 is handed out as one piece beginning with the image's frame: `temporal` frames more than chunk 0 without
  an image (its first latent frame decodes to `temporal` frames, not 1), so chunk indices, `prompt_schedule` and
  switch chunks, and a live session's chunk events and fMP4 fragments number exactly as without an image (one
  event and one fragment per chunk; chunk 0's `t` is when it, image frame included, left the engine);
- a request without an image is unchanged, byte for byte.

The engine's memory for a request is fixed: per row one `KVCache` (engine/models/causal.py),
the latents of the cached frames (for a recache), the current chunk, and the streaming VAE's cache.
"""

from __future__ import annotations

import math
import operator
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from longserve.engine.config import EngineConfig, FamilyFacts, ModelDescription
from longserve.engine.decoding import FramesPolicy, WanVAEDecoder, decoded_frames
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    check_common,
    generation_defaults,
    read_json,
    seeded_generator,
    sync_cuda,
)
from longserve.engine.families.wan_parts import MAX_SEQUENCE_LENGTH, WanParts, vae_factors
from longserve.engine.images import as_rgb_array, to_pil
from longserve.engine.live_frames import FrameSlots
from longserve.engine.live_loop import lane_request, loop_roles, solo_group
from longserve.engine.live_stages import stage_cache, stage_plan, step_groups
from longserve.engine.models.causal import CausalConfig, CausalWan, KVCache
from longserve.engine.outputs import LiveChunkInfo
from longserve.engine.parallel import ParallelPlan
from longserve.engine.request import GenerationSpec, RequestError

CAUSAL_CONFIG_FILE = "causal_config.json"
#: set to 1 by `bench` (timing mode): the loop then waits for the device after each step and around a recache,
#: so `timings["transformer_s"]` holds the kernels' time; otherwise it never syncs inside the loop
TIMED_STAGES_ENV = "LONGSERVE_TIMED_STAGES"
OPTIONS = ("prompt_schedule", "image")


def chunk_frames(chunks: int, frames_per_block: int, temporal: int, lead: int = 0) -> int:
    """Pixel frames of the first `chunks` chunks, after `lead` latent frames of a start image."""
    return decoded_frames(lead + chunks * frames_per_block, temporal)


@dataclass(frozen=True)
class CausalFacts(FamilyFacts):
    config: CausalConfig                  # the chunk loop (causal_config.json)
    layers: int                           # the transformer's, for the KV cache's size
    head_dim: int
    patch: tuple[int, int, int]
    vae_spatial: int
    vae_temporal: int


@dataclass
class CausalRequest(WorkerRequest):
    cfg: CausalConfig = None
    caches: list = field(default_factory=list)      # one KVCache per row
    generator: torch.Generator = None
    num_chunks: int = 0
    latent_frames: int = 0                          # of the video, the start image's included
    lead: int = 0                                   # latent frames before chunk 0's: 1 with a start image
    image_latent: torch.Tensor = None               # the start image's, until it goes out in front of chunk 0
    chunk: int = 0                                  # the chunk being made
    phase: int = 0                                  # its next forward: 0..n-1 denoise, n context pass
    x: torch.Tensor = None                          # the chunk's noisy latents (B, C, fb, h, w), float32
    x0: torch.Tensor = None                         # the chunk once final
    noise: torch.Tensor = None                      # the chunk's noises, drawn at its start (n, B, C, fb, h, w)
    texts: dict = field(default_factory=dict)       # prompt index -> (B, L, C_text): the current and scheduled
    prompt_index: int = 0
    schedule: dict = field(default_factory=dict)    # chunk -> prompt index (the request's prompt_schedule)
    pending_prompt: tuple | None = None             # (index, text) asked mid-chunk: applied at the next chunk
    switched_chunk: int = -1                        # the chunk a switch was last applied at (one per chunk)
    clean: torch.Tensor = None                      # the cached frames' clean latents, by cache slot

    def switch_ready(self) -> bool:
        return self.phase == 0 and not self.denoised and self.switched_chunk != self.chunk

    def chunk_steps(self) -> int:
        return self.cfg.steps_per_chunk

    def chunk_now(self) -> int:
        return self.chunk

    def chunk_start(self) -> bool:
        return self.phase == 0 and not self.denoised


class CausalWanFamily(WanParts, VideoFamily):
    """Self-Forcing / LongLive / CausVid-style checkpoints on diffusers' `WanTransformer3DModel`."""

    name = "causal-wan"
    plans = ("ulysses",)
    auto_plan = "sequence"
    pipeline_classes = frozenset()          # claimed by causal_config.json, not by model_index.json
    supports_lora = False                   # its own step and cached attention: no per-row adapters
    supports_compile = True                 # regional compile: the cached attention runs eager between graphs
    supports_cuda_graphs = True             # and those graphs replayed: a chunk's shapes never change
    dispatcher_attention_note = ("its attention reads and writes longserve's own KV cache, a prefix slice per row "
                                 "(PyTorch SDPA), which diffusers' dispatcher does not run")

    @classmethod
    def claims(cls, model_dir: Path) -> bool:
        return (Path(model_dir) / CAUSAL_CONFIG_FILE).is_file()

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        cfg = CausalConfig.from_dict(read_json(model_dir / CAUSAL_CONFIG_FILE))
        t = read_json(model_dir / "transformer" / "config.json")
        spatial, temporal = vae_factors(read_json(model_dir / "vae" / "config.json"))
        fallback = {"height": 480, "width": 832, "num_frames": chunk_frames(7, cfg.frames_per_block, temporal),
                    "num_inference_steps": len(cfg.timesteps), "guidance_scale": 1.0, "fps": cfg.fps}
        return ModelDescription(
            family=cls.name, pipeline="CausalWan", heads=t["num_attention_heads"],
            size_multiple=spatial * t["patch_size"][1], frame_multiple=temporal * t["patch_size"][0],
            defaults=generation_defaults(model_dir, fallback), options=OPTIONS,
            capabilities=cls.capabilities(OPTIONS, long_video=True, live=True, image="optional",
                                          frames_per_chunk=cfg.frames_per_block * temporal * t["patch_size"][0],
                                          live_window=cfg.local_attn_size),
            facts=CausalFacts(config=cfg, layers=t["num_layers"], head_dim=t["attention_head_dim"],
                              patch=tuple(t["patch_size"]), vae_spatial=spatial, vae_temporal=temporal))

    @classmethod
    def resolve_plan(cls, desc: ModelDescription, parallel: str, workers: int, ulysses_degree: int | None = None,
                     cfg_parallel: bool = False) -> ParallelPlan:
        if cfg_parallel:
            raise ValueError("cfg_parallel does not apply to causal models (they run without guidance)")
        if parallel not in ("auto", "ulysses"):
            raise ValueError(f"parallel must be 'auto' or 'ulysses' for a causal model (its chunks are sharded "
                             f"with Ulysses, heads padded when fewer than the workers); got {parallel!r}")
        if ulysses_degree not in (None, 1, workers):
            raise ValueError("ulysses_degree does not apply to a causal model (all workers form one Ulysses group)")
        return ParallelPlan("ulysses")

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        n = len(desc.facts.config.timesteps)
        if spec.num_inference_steps != n:
            raise RequestError("num_inference_steps", f"this causal model denoises every chunk in exactly {n} steps "
                                                      f"(its denoising_step_list); got {spec.num_inference_steps}")
        if spec.guidance_scale > 1.0:
            raise RequestError("guidance_scale", f"causal few-step models run without classifier-free guidance: "
                                                 f"guidance_scale must be at most 1; got {spec.guidance_scale}")
        schedule = spec.options.get("prompt_schedule")
        if schedule is not None:
            if spec.batch_size != 1:
                raise RequestError("prompt_schedule", "a prompt schedule is for one video (one prompt)")
            ok = isinstance(schedule, (list, tuple)) and schedule and all(
                isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], int) and not isinstance(e[0], bool)
                and isinstance(e[1], str) and e[1].strip() for e in schedule)
            chunks = [e[0] for e in schedule] if ok else []
            if not ok or chunks[0] != 0 or any(b <= a for a, b in zip(chunks, chunks[1:])):
                raise RequestError("prompt_schedule", "prompt_schedule must be a list of [chunk, prompt] pairs "
                                                      "with non-empty prompts, the first at chunk 0, chunks "
                                                      f"increasing; got {schedule!r}")
            spec.options = {**spec.options, "prompt_schedule": [[int(c), p] for c, p in schedule]}
            spec.prompt = [schedule[0][1]]
        if spec.options.get("image") is not None:
            spec.options = {**spec.options, "image": as_rgb_array(spec.options["image"], "image")}
        else:
            spec.options = {k: v for k, v in spec.options.items() if k != "image"}
        check_common(desc, spec)
        temporal = desc.facts.vae_temporal
        if "image" in spec.options and spec.num_frames < 1 + temporal:
            raise RequestError("num_frames", f"from a start image the video is the image's frame and at least one "
                                             f"made latent frame: num_frames must be at least {1 + temporal}; got "
                                             f"{spec.num_frames}")
        return spec

    @classmethod
    def check_decoder(cls, config, desc: ModelDescription, model_dir: Path) -> None:
        """`decoder` "tiny" or a TAEHV file: it must load and take this model's latents (ValueError naming it)."""
        if config.decoder != "vae":
            from longserve.engine.small_decoder import open_small_decoder

            open_small_decoder(config.decoder, model_dir)

    @classmethod
    def check_update(cls, desc: ModelDescription, spec: GenerationSpec, payload: dict) -> dict:
        unknown = sorted(set(payload) - {"prompt", "stop"})
        if unknown or not payload:
            raise RequestError(unknown[0] if unknown else "request", "a running causal request takes prompt= (a "
                                                                     "new prompt) or stop=True")
        if "prompt" in payload:
            p = payload["prompt"]
            if not isinstance(p, str) or not p.strip():
                raise RequestError("prompt", f"prompt must be a non-empty string; got {p!r}")
            if spec.batch_size != 1:
                raise RequestError("prompt", "a prompt switch is for a one-video request")
        if "stop" in payload and payload["stop"] is not True:
            raise RequestError("stop", f"stop must be true; got {payload['stop']!r}")
        return dict(payload)

    @classmethod
    def kv_bytes(cls, desc: ModelDescription, spec: GenerationSpec, config: EngineConfig) -> int:
        """Per worker: one KVCache per video (engine/models/causal.py), at the engine's dtype."""
        from longserve.engine.dist import parse_dtype

        f = desc.facts
        tokens = (spec.height // f.vae_spatial // f.patch[1]) * (spec.width // f.vae_spatial // f.patch[2])
        denoisers = loop_roles(config.live_loop, config.workers).denoisers     # pipelined: not the decode rank
        # stages: a stage's blocks' layers, every head, a stream batch's chunks (engine/live_stages.py)
        layers, heads, chunks = stage_cache(f.layers, desc.heads, config) if config.live_loop == "stages" else (
            f.layers, math.ceil(desc.heads / len(denoisers)), 1)
        per_video = KVCache.nbytes(f.config, layers, tokens, heads, desc.heads, f.head_dim, MAX_SEQUENCE_LENGTH,
                                   parse_dtype(config.dtype).itemsize, chunks)
        return per_video * spec.batch_size

    # -- worker side --------------------------------------------------------------------------------

    def __init__(self, ctx, config):
        import diffusers
        import transformers

        from longserve.weights.causal_wan import load_causal_transformer

        super().__init__(ctx, config)
        diffusers.utils.logging.disable_progress_bar()
        model_dir = base = Path(config.model_dir)
        self.desc = self.describe(model_dir)
        self.cfg = self.desc.facts.config
        device = self.pg.device
        transformer = load_causal_transformer(model_dir, self.dtype).to(device)
        index = read_json(base / "model_index.json")
        tokenizer = text_encoder = None
        if self.pg.rank == 0:          # the text encoder on rank 0 only (it broadcasts the embeddings)
            tokenizer = transformers.AutoTokenizer.from_pretrained(base / "tokenizer")
            text_encoder = getattr(transformers, index["text_encoder"][1]).from_pretrained(
                base / "text_encoder", dtype=self.dtype).to(device)
        vae = diffusers.AutoencoderKLWan.from_pretrained(base / "vae", torch_dtype=self.component_dtypes()["vae"]
                                                         ).to(device)   # float32 unless --vae-dtype says otherwise
        scheduler = getattr(diffusers, index["scheduler"][1]).from_pretrained(base / "scheduler")
        self.pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                                          vae=vae, scheduler=scheduler)
        self.pipe.set_progress_bar_config(disable=True)
        # compile (and FP8) of diffusers' blocks; no step caching: its own KV-cached forward (engine/models/causal.py),
        # whose cached attention is a deliberate graph break in a compiled block
        self.model, = self.load_denoisers(Denoisers((transformer,), blocks=operator.attrgetter("blocks")))
        self.vae_spatial, self.vae_temporal = vae_factors(dict(vae.config))
        self.slots = FrameSlots()         # a chunk's uint8 frames leave through shared memory (engine/live_frames.py)
        self.lane = None                  # the decode lane, on the rank that decodes outside the serial loop
        self.set_plan(config.plan)        # Ulysses over the denoising workers, no CFG-parallel (resolve_plan)
        self.timed = os.environ.get(TIMED_STAGES_ENV) == "1"
        self.small_decoder = None
        if config.engine.decoder != "vae":        # the live frames through a small decoder (rank 0 decodes them)
            from longserve.engine.small_decoder import open_small_decoder

            self.small_decoder = open_small_decoder(config.engine.decoder, model_dir).to(
                device, self.component_dtypes()["vae"])

    def component_dtypes(self) -> dict:
        """As the Wan family's, but the VAE defaults to bfloat16 on CUDA: a live stream decodes every chunk, and
        bf16 halves its cost within bf16 rounding (tests/engine/test_causal_vae.py); float32 stays the CPU's."""
        dtypes = super().component_dtypes()
        if self.config.engine.vae_dtype is None and self.pg.device.type == "cuda":
            dtypes["vae"] = torch.bfloat16
        return dtypes

    def _timed_sync(self) -> None:
        if self.timed:
            sync_cuda()

    def set_plan(self, plan) -> None:
        """The live loop's roles (engine/live_loop.py), then Ulysses over the ranks that run the transformer: every
        worker, or in the pipelined loop all but the last, which decodes (collective: `new_group` is)."""
        import torch.distributed as dist

        from longserve.engine.live_lane import DecodeLane
        from longserve.engine.live_loop import lane_threads
        from longserve.engine.parallel import make_sequence_parallel

        self.roles = loop_roles(self.config.engine.live_loop, self.pg.world_size)
        self.model = getattr(self.model, "causal", self.model)           # the staged model's whole one
        if self.roles.loop == "stages":                 # a stage of the blocks per rank (engine/live_stages.py)
            stage_plan(self, plan)
        elif self.roles.transfer:
            ranks = list(self.roles.denoisers)
            group = dist.new_group(ranks)
            self.tpg = self.pg.subgroup(ranks, group) if self.pg.rank in ranks else None
            self.sp = None if self.tpg is None else make_sequence_parallel(
                self.tpg, plan.name, plan.ulysses_degree, attention_backend=self.config.engine.attention_backend)
            self.cfg_groups, self.sp_cfg, self.plan = None, None, plan
        else:
            super().set_plan(plan)
            self.tpg = self.pg
        if self.pg.rank == self.roles.lane and self.lane is None:
            self.lane = DecodeLane(self.pg.device, lane_threads())

    @property
    def text_group(self):
        return self.tpg

    @property
    def decode_only(self) -> bool:
        """This rank only decodes (the pipelined loop's last): no transformer, no text, no KV cache."""
        return self.roles.transfer and self.pg.rank == self.roles.lane

    def vae_decoder(self, spec: GenerationSpec, latents: torch.Tensor):
        """The Wan VAE's streaming decode (across the workers in the serial loop; on the lane's rank alone
        otherwise) or the small decoder (rank 0's, or the lane's), whose frames leave as uint8 in a shared-memory
        slot unless the request wants latents."""
        slots = self.slots if spec.output in ("np", "uint8") else None
        if self.small_decoder is not None:
            from longserve.engine.small_decoder import SmallDecoderPath

            rank = self.pg.rank if self.roles.lane is None else 0      # the lane decodes as a group of one
            return SmallDecoderPath(self.small_decoder, rank, spec.output, slots)
        if self.roles.lane is None:
            return WanVAEDecoder(self.pipe, self.pg, latents, self.vae_tiling, spec.output, split=self.vae_split,
                                 slots=slots)
        return WanVAEDecoder(self.pipe, solo_group(self.pg), latents, self.vae_tiling, spec.output, slots=slots)

    def shard(self, denoiser):
        model = CausalWan(denoiser, self.cfg)
        model.cuda_graphs = self.config.engine.cuda_graphs
        return model

    # -- a request ----------------------------------------------------------------------------------

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 embeddings of `prompts` (rank 0 encodes, every rank gets them): (len, L, C_text)."""
        def run():
            with torch.no_grad():
                return self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                               num_videos_per_prompt=1, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                               device=self.pg.device)[0].cpu()

        return self.broadcast_from_first(run).to(self.pg.device, self.dtype)

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the start image as one normalised latent frame (B, C, 1, h, w), as Wan's image-to-video pipeline
        encodes its first frame (`video_processor.preprocess`, the VAE's mode, `latents_mean` / `latents_std`)."""
        if spec.options.get("image") is None:
            return {}
        vae, device = self.pipe.vae, self.pg.device
        pixels = self.pipe.video_processor.preprocess(to_pil(spec.options["image"]), height=spec.height,
                                                      width=spec.width).to(device, vae.dtype)  # (1, 3, H, W)
        latent = vae.encode(pixels[:, :, None]).latent_dist.mode().float()                     # (1, z, 1, h, w)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean, device=device).view(1, z, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=device).view(1, z, 1, 1, 1)
        return {"image_latent": ((latent - mean) / std).expand(spec.batch_size, -1, -1, -1, -1).contiguous()}

    def _hold_image(self, r: CausalRequest, latent: torch.Tensor) -> None:
        """The start image's latent frame written into every row's cache as clean context (frame 0)."""
        B = latent.shape[0]
        text = r.texts[r.prompt_index].expand(B, -1, -1)
        t = torch.full((B,), self.cfg.context_noise, device=self.pg.device)
        with torch.no_grad():
            self.model(latent.to(self.dtype), t, text, self.sp, r.caches, [r.prompt_index] * B, [True] * B)
        r.clean[:, :, r.caches[0].slot_of(0)] = latent[:, :, 0].float()

    def admit(self, spec: GenerationSpec) -> CausalRequest:
        if not self.decode_only:
            return super().admit(spec)
        return lane_request(self, spec, CausalRequest)      # the decode rank's: the frame stream alone

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, image_latent: torch.Tensor = None) -> CausalRequest:
        cfg = self.cfg
        latent_frames = (spec.num_frames - 1) // self.vae_temporal + 1
        lead = 0 if image_latent is None else image_latent.shape[2]       # the start image's frame comes first
        num_chunks = -(-(latent_frames - lead) // cfg.frames_per_block)
        B, h, w = spec.batch_size, spec.height // self.vae_spatial, spec.width // self.vae_spatial
        texts, schedule = {0: text}, {}
        entries = spec.options.get("prompt_schedule") or []
        if len(entries) > 1:
            more = self.encode([p for _, p in entries[1:]])
            texts.update({i + 1: more[i:i + 1] for i in range(len(entries) - 1)})
            schedule = {c: i for i, (c, _) in enumerate(entries) if i > 0}
        C = self.pipe.transformer.config.in_channels
        r = CausalRequest(spec=spec, num_steps=num_chunks * cfg.steps_per_chunk - 1, batch_key=(),
                          num_frames=spec.num_frames, cfg=cfg, generator=seeded_generator(spec.seed),
                          num_chunks=num_chunks, latent_frames=latent_frames, lead=lead, texts=texts,
                          schedule=schedule, chunks_per_job=getattr(self.model, "stream_batch", 1),
                          caches=[self.model.new_cache(h, w, self.sp, text.shape[1]) for _ in range(B)],
                          clean=torch.zeros(B, C, cfg.capacity, h, w, device=self.pg.device),
                          # a chunk is the unit a live client sees: decoded whole, one per call
                          frames=self.frame_stream(spec, spec.num_frames, FramesPolicy(self.vae_temporal, whole=True)))
        if image_latent is not None:
            self._hold_image(r, image_latent)
            r.image_latent = image_latent.float()
        self._start_chunk(r)
        return r

    def batch_key(self, r: CausalRequest) -> tuple:
        if r.denoised:
            return ("causal", "done")
        return ("causal", *(r.x if r.x is not None else r.x0).shape[1:])

    def _chunk_noise(self, r: CausalRequest, shape: tuple) -> torch.Tensor:
        """Every noise a chunk takes, drawn at its start: its starting latents and one per denoising step but the
        last, (n, *shape). Drawn in the order and sizes the steps used to draw them, from the request's CPU
        generator (a seed makes the same video on any device), into one pinned buffer moved without a sync."""
        n = len(self.cfg.timesteps)
        pin = self.pg.device.type == "cuda"
        noise = torch.empty((n, *shape), dtype=torch.float32, pin_memory=pin)
        for i in range(n):
            torch.randn(shape, generator=r.generator, out=noise[i])
        return noise.to(self.pg.device, non_blocking=pin)

    def _start_chunk(self, r: CausalRequest) -> None:
        """A new chunk from fresh noise, under the prompt that applies from it (a switch recaches first)."""
        if r.pending_prompt is not None:
            index, prompt = r.pending_prompt
            r.texts[index] = self.encode([prompt])
            self._switch(r, index)
        elif r.schedule.get(r.chunk, r.prompt_index) != r.prompt_index:
            self._switch(r, r.schedule[r.chunk])
        r.pending_prompt = None
        B, C = r.spec.batch_size, self.pipe.transformer.config.in_channels
        h, w = r.spec.height // self.vae_spatial, r.spec.width // self.vae_spatial
        r.noise = self._chunk_noise(r, (B, C, self.cfg.frames_per_block, h, w))
        r.x = r.noise[0]
        r.phase = 0
        r.batch_key = self.batch_key(r)

    def _switch(self, r: CausalRequest, index: int) -> None:
        """Prompt `index` from now: the cached frames' K/V are recomputed under it (oldest first, a chunk's worth
        of frames per context pass), then its text K/V on the next forward. The texts no prompt to come needs
        are let go (a session's history stays bounded)."""
        r.prompt_index, r.switched_chunk = index, r.chunk
        keep = {index, *(i for c, i in r.schedule.items() if c > r.chunk)}
        r.texts = {i: t for i, t in r.texts.items() if i in keep}
        order = sorted((f, s) for s, f in enumerate(r.caches[0].slot_frame) if f >= 0)
        if not order:
            return
        self._timed_sync()
        t0 = time.perf_counter()
        latents = r.clean[:, :, [s for _, s in order]]                    # (B, C, P, h, w), oldest first
        for c in r.caches:
            c.reset()
        fb, B = self.cfg.frames_per_block, latents.shape[0]
        text = r.texts[index].expand(B, -1, -1)
        t = torch.full((B,), self.cfg.context_noise, device=self.pg.device)
        with torch.no_grad():
            for g in range(0, latents.shape[2], fb):
                part = latents[:, :, g:g + fb]
                self.model(part.to(self.dtype), t, text, self.sp, r.caches, [index] * B, [True] * B)
                for i in range(part.shape[2]):
                    r.clean[:, :, r.caches[0].slot_of(g + i)] = part[:, :, i]
        self._timed_sync()
        r.timings["transformer_s"] += time.perf_counter() - t0

    def step(self, reqs: list[CausalRequest]) -> None:
        """One forward for every request's rows (each at its own phase), then each request's update."""
        if self.decode_only:
            return
        if self.roles.loop == "stages":               # each request's next group of chunks (engine/live_stages.py)
            return step_groups(self, reqs)
        t0 = time.perf_counter()
        n, cfg = len(self.cfg.timesteps), self.cfg
        xs, ts, texts, caches, versions, writes = [], [], [], [], [], []
        for r in reqs:
            B = r.spec.batch_size
            context = r.phase == n
            xs.append((r.x0 if context else r.x).to(self.dtype))
            ts.append(torch.full((B,), cfg.context_noise if context else cfg.timesteps[r.phase],
                                 device=self.pg.device))
            texts.append(r.texts[r.prompt_index].expand(B, -1, -1))
            caches += r.caches
            versions += [r.prompt_index] * B
            writes += [context] * B
        with torch.no_grad():
            out = self.model(torch.cat(xs), torch.cat(ts), torch.cat(texts), self.sp, caches,
                             versions, writes).float()
        rows = 0
        for r in reqs:
            pred = out[rows:rows + r.spec.batch_size]
            rows += r.spec.batch_size
            self._advance(r, pred)
        self._timed_sync()
        elapsed = time.perf_counter() - t0
        for r in reqs:
            r.timings["transformer_s"] += elapsed / len(reqs)

    def _advance(self, r: CausalRequest, pred: torch.Tensor) -> None:
        n, cfg = len(self.cfg.timesteps), self.cfg
        r.steps_done += 1
        if r.phase < n:
            x0 = r.x - cfg.sigma(cfg.timesteps[r.phase]) * pred
            if r.phase < n - 1:
                s = cfg.sigma(cfg.timesteps[r.phase + 1])
                r.x = (1 - s) * x0 + s * r.noise[r.phase + 1]
                r.phase += 1
            else:
                r.x0, r.x = x0, None
                self.push_final(r, r.chunk, x0)
                r.phase = n
        else:                                   # the context pass wrote the chunk: keep its clean latents
            first = r.caches[0].frames_written - r.x0.shape[2]
            for i in range(r.x0.shape[2]):
                r.clean[:, :, r.caches[0].slot_of(first + i)] = r.x0[:, :, i]
            r.chunk += 1
            r.x0 = None
            self._start_chunk(r)
        if r.denoised:
            r.x = r.x0 = r.noise = None
        r.batch_key = self.batch_key(r) if r.x is not None or r.x0 is not None else ("causal", "done")

    def push_final(self, r: CausalRequest, chunk: int, x0: torch.Tensor) -> None:
        """A chunk's final latents to the frame stream, but frames past the video's end; chunk 0 behind the start
        image's frame (one piece, one decode: the VAE's cache carries into it)."""
        made = x0[:, :, :r.latent_frames - r.lead - chunk * self.cfg.frames_per_block]
        if r.image_latent is not None:
            made, r.image_latent = torch.cat([r.image_latent, made], dim=2), None
        r.frames.push(made, live=LiveChunkInfo(chunk, r.prompt_index))

    def update(self, r: CausalRequest, payload: dict) -> dict:
        """A new prompt (applied at the next chunk boundary; at once when no forward of the current chunk ran
        yet) or stop (after the chunk being made). Returns the progress and, for a prompt, where it applies."""
        if self.decode_only:            # a stop's frame limit comes with the chunks (engine/live_loop.py)
            return {"progress": r.progress()}
        info = {}
        if "prompt" in payload:
            index = payload.get("prompt_index", r.prompt_index + 1)    # the scheduler's numbering
            r.schedule = {c: i for c, i in r.schedule.items() if c <= r.chunk}   # a live switch overrides the rest
            if r.switch_ready():
                # between chunks (this chunk is already the next one): applied now, once per chunk
                r.texts[index] = self.encode([payload["prompt"]])
                r.schedule.pop(r.chunk, None)
                r.pending_prompt = None
                self._switch(r, index)
                info = {"prompt_index": index, "chunk": r.chunk}
            else:                               # mid-chunk: encoded when the next chunk starts (or replaced)
                r.pending_prompt = (index, payload["prompt"])
                info = {"prompt_index": index, "chunk": r.chunk + 1}
        if payload.get("stop") and not r.denoised:
            # the chunk being made is the last (at a boundary: the one about to start, so that a chunk always
            # follows a stop and ends the request; or, outside the serial live loop, where the chunk before it is
            # still to be decoded beside it, that one); a final chunk's context pass is not needed
            n = len(self.cfg.timesteps)
            pending = r.phase == 0 and r.chunk > 0 and r.decodable()
            chunks = r.chunk + (0 if pending else 1)
            r.num_chunks = chunks
            r.num_steps = r.steps_done + (0 if pending else n - r.phase)
            r.num_frames = r.frames.limit = min(r.num_frames, chunk_frames(chunks, self.cfg.frames_per_block,
                                                                            self.vae_temporal, r.lead))
            r.latent_frames = min(r.latent_frames, r.lead + chunks * self.cfg.frames_per_block)
            if r.denoised:                       # phase n (or a pending chunk): the chunk was final already
                r.x = r.x0 = r.noise = None
                r.batch_key = ("causal", "done")
        return {"progress": r.progress(), **info}


FAMILY = CausalWanFamily

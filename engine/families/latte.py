"""The Latte family (`LattePipeline` checkpoints: Latte-1 and the shipped tiny-latte): loading, prompts,
latents, batched steps and the frame-split VAE path. The parallel forwards are `engine/models/latte.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from longserve.engine import comm
from longserve.engine.config import ModelDescription
from longserve.engine.decoding import FramesPolicy, to_pixels
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    cfg_rows,
    check_common,
    generation_defaults,
    read_json,
    scheduler_step_kwargs,
    seeded_generator,
)
from longserve.engine.models.latte import STRATEGIES, check_strategy, parallel_forward
from longserve.engine.parallel import ParallelPlan, make_cfg_groups
from longserve.engine.request import GenerationSpec


def pad_text(texts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate prompt embeddings of different lengths: zero-pad, and a mask when lengths differ.

    [(b_i, L_i, C)] -> (sum b_i, max L_i, C), mask (sum b_i, max L_i) or None
    """
    L = max(t.shape[1] for t in texts)
    if all(t.shape[1] == L for t in texts):
        return torch.cat(texts), None
    padded = torch.cat([comm.pad_dim(t, 1, L) for t in texts])
    mask = torch.cat([(torch.arange(L, device=t.device) < t.shape[1]).expand(t.shape[0], L) for t in texts])
    return padded, mask


def select_attention(transformer, device: torch.device, attention: str) -> str:
    """xformers on CUDA when installed (and asked for or 'auto'); else PyTorch SDPA."""
    if device.type == "cuda" and attention in ("auto", "xformers"):
        try:
            import xformers  # noqa: F401

            transformer.enable_xformers_memory_efficient_attention()
            return "xformers"
        except ImportError:
            if attention == "xformers":
                raise ValueError("attention='xformers' but xformers is not installed (pip install '.[gpu]')") from None
    return "sdpa"


class LatteFamily(VideoFamily):
    """`LattePipeline` checkpoints."""

    name = "latte"
    pipeline_classes = frozenset({"LattePipeline"})
    plans = STRATEGIES
    auto_plan = "dsp"
    supports_compile = True
    dispatcher_attention_note = ("Latte's forward is longserve's own (DSP) with PyTorch SDPA, or xformers through "
                                 "the `attention` option (auto | sdpa | xformers)")

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        index = read_json(Path(model_dir) / "model_index.json")
        cfg = read_json(Path(model_dir) / "transformer" / "config.json")
        vae = read_json(Path(model_dir) / "vae" / "config.json")
        vae_scale = 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1)
        native = cfg["sample_size"] * vae_scale
        defaults = generation_defaults(model_dir, {
            "num_frames": cfg["video_length"], "height": native, "width": native, "num_inference_steps": 50,
            "guidance_scale": 7.5, "fps": 8})
        return ModelDescription(family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
                                size_multiple=vae_scale * cfg["patch_size"], frame_multiple=1, defaults=defaults,
                                options=("cache", "cfg_trunc_ratio"),
                                capabilities=cls.capabilities(("cache",)))

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        check_common(desc, spec)
        return cls.check_cache(desc, spec)

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.pipe = self.load_pipeline(diffusers.LattePipeline, self.dtype)
        if self.vae_tiling:
            self.pipe.vae.enable_tiling()  # per frame, so any split of the frames across workers decodes alike
        self.attention = select_attention(self.pipe.transformer, self.pg.device, config.engine.attention)
        self.split_variance = getattr(self.pipe.scheduler.config, "variance_type", None) not in (
            "learned", "learned_range")
        # compiled: the spatial and temporal blocks (DSP's forward calls them; the embedded baselines run them eager);
        # step caching: the head is the first spatial block, the rest every other block (engine/cache.py), through
        # the forward itself (no hooks); the sharded forward is the hand-written DSP one (engine/models/latte.py)
        self.load_denoisers(Denoisers((self.pipe.transformer,), blocks=spatial_and_temporal_blocks,
                                      cache_units=2 * len(self.pipe.transformer.transformer_blocks)))
        self._cfg = None
        self.set_plan(config.plan)

    def set_plan(self, plan: ParallelPlan) -> None:
        check_strategy(plan.name)
        if plan.name == "megatron-sp" and self.config.engine.quantize == "fp8":
            raise ValueError("quantize='fp8' cannot run megatron-sp: it slices the linear layers' weights by hand")
        if plan.cfg_parallel and self.pg.world_size > 1:
            if self._cfg is None:
                self._cfg = make_cfg_groups(self.pg)   # new_group is collective: built once, kept
            self.cfg_groups = self._cfg
        else:
            self.cfg_groups = None
        self.plan = plan

    # -- a request ---------------------------------------------------------------------------------------

    def encode_prompt(self, spec: GenerationSpec):
        return self.pipe.encode_prompt(spec.prompt, spec.use_cfg, negative_prompt=spec.negative_prompt,
                                       num_images_per_prompt=1, device=self.pg.device, clean_caption=False,
                                       mask_feature=True)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor) -> WorkerRequest:
        pipe = self.pipe
        scheduler = self.new_scheduler(spec.num_inference_steps)
        shape = (spec.batch_size, pipe.transformer.config.in_channels, spec.num_frames,
                 spec.height // pipe.vae_scale_factor, spec.width // pipe.vae_scale_factor)
        # the noise diffusers draws with generator=torch.Generator("cpu").manual_seed(seed); the same
        # generator then feeds samplers that add noise at every step
        generator = seeded_generator(spec.seed)
        noise = torch.randn(shape, generator=generator, dtype=self.dtype)
        return WorkerRequest(spec=spec, num_steps=len(scheduler.timesteps), batch_key=("latte", *shape),
                             num_frames=spec.num_frames, text=text, scheduler=scheduler,
                             latents=noise.to(self.pg.device) * scheduler.init_noise_sigma,
                             step_kwargs=scheduler_step_kwargs(scheduler, generator),
                             frames=self.frame_stream(spec, spec.num_frames, FramesPolicy()))   # a frame per frame

    def inputs(self, r: WorkerRequest) -> dict:
        t = r.scheduler.timesteps[r.steps_done]
        x = r.scheduler.scale_model_input(cfg_rows(r, r.latents), t)                  # (2B|B, C, T, h, w)
        return {"x": x, "t": t.reshape(1).expand(x.shape[0]), "text": r.text}

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        # prompts of different lengths share the forward: padded text tokens are masked out of cross-attention
        text, mask = pad_text(inputs["text"])
        return parallel_forward(model, torch.cat(inputs["x"]), torch.cat(inputs["t"]).to(self.pg.device), text,
                                self.pg, self.plan.name, cfg=self.cfg_groups if cfg_parallel else None,
                                encoder_attention_mask=mask, cache=self.step_cache.active)  # (rows, C_out, T, h, w)

    def vae_decoder(self, spec: GenerationSpec, latents: torch.Tensor) -> "LatteDecoder":
        return LatteDecoder(self.pipe, self.pg, spec)


def spatial_and_temporal_blocks(transformer) -> list:
    return [*transformer.transformer_blocks, *transformer.temporal_transformer_blocks]


class LatteDecoder:
    """Latte's VAE is per frame: each rank decodes its share of the B*n frames of a call in chunks of the request's
    `decode_chunk_size`; rank 0 gathers them (as uint8 for that output: a quarter of the bytes)."""

    def __init__(self, pipe, pg, spec: GenerationSpec):
        self.pipe, self.pg, self.chunk, self.output = pipe, pg, spec.decode_chunk_size, spec.output

    def decode(self, latents: torch.Tensor, keep: slice):
        pipe, pg = self.pipe, self.pg
        B, C, n, h, w = latents.shape
        frames = latents.permute(0, 2, 1, 3, 4).flatten(0, 1)                      # (B*n, C, h, w)
        frames = frames / pipe.vae.config.scaling_factor
        mine = comm.shard(frames, 0, pg)                                           # (ceil(B*n/N), C, h, w)
        count = comm.valid_length(B * n, pg)                                       # real frames in my shard
        with torch.no_grad():
            outs = [pipe.vae.decode(mine[i:min(i + self.chunk, count)]).sample for i in range(0, count, self.chunk)]
        f = pipe.vae_scale_factor
        decoded = torch.cat(outs) if outs else mine.new_zeros((0, pipe.vae.config.out_channels, h * f, w * f))
        if self.output == "uint8":
            # what to_pixels makes of it, done here: a quarter of the bytes to gather
            decoded = ((decoded.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        decoded = comm.pad_dim(decoded, 0, mine.shape[0])                          # (ceil(B*n/N), 3, H, W)
        shards = comm.gather_to(decoded, 0, pg)                                    # (N, ceil(B*n/N), 3, H, W)
        if pg.rank != 0:
            return None
        video = shards.flatten(0, 1)[:B * n]                                       # (B*n, 3, H, W)
        video = video.reshape(B, n, *video.shape[1:])[:, keep]                     # (B, n', 3, H, W)
        if self.output == "uint8":
            return video.permute(0, 1, 3, 4, 2).cpu().numpy()                      # (B, n', H, W, 3)
        return to_pixels(video.permute(0, 2, 1, 3, 4), pipe.video_processor, self.output)

    def close(self) -> None:
        pass


FAMILY = LatteFamily

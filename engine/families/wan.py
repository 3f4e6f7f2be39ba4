"""The Wan family (`WanPipeline`: Wan 2.1, Wan 2.2 with two experts; `SkyReelsV2Pipeline`): full-attention
video DiTs, sharded on the sequence of F x H x W tokens.

The parallel forward drives diffusers' own modules and weights (`rope`, `patch_embedding`,
`condition_embedder`, every `WanTransformerBlock` / `SkyReelsV2TransformerBlock`,
`norm_out`, `proj_out`); only the self-attention processor of each block is ours, so that
the sequence-parallel exchange (engine/parallel.py: Ulysses, Ring, USP) happens inside it.
Cross-attention (text keys, replicated), the FFN, norms and modulation are per token and
stay local. Shapes: B batch, S = f*h*w tokens (frame-major), Sl = ceil(S/N) tokens per
rank (zero-padded on the last ranks), D hidden, H heads, hd head dim.

Per forward and rank, with N sequence-parallel workers, L blocks, e bytes per element:
- ulysses: 2 all-to-alls per block (Q, K and V fused into one; the output), each sending
  (N-1)/N of B*Sl*Hp*hd elements (x3 for QKV), Hp = ceil(H/N)*N (heads zero-padded);
- ring: N-1 sends per block of one fused K/V block, 2*B*H*Sl*hd elements each;
- usp (Ulysses degree k, ring degree N/k): the Ulysses all-to-alls within k ranks, then
  N/k - 1 sends of 2*B*ceil(H/k)*k*Sl*hd... per block;
- all: one all-gather of the output tokens, (N-1)*B*Sl*p*C_out elements.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import comm
from engine.families.base import (Timer, VideoFamily, WorkerRequest, check_number, generation_defaults, guided,
                                  order_rows, read_json, scheduler_step_kwargs, seeded_generator, split_rows,
                                  sync_cuda, to_pixels)
from engine.parallel import (BlockCausal, CfgGroups, ParallelPlan, SequenceParallel, make_cfg_groups,
                             make_sequence_parallel, sequence_parallel_attention)
from engine.request import GenerationSpec, RequestError

# -- the parallel forward ----------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs. x (B, Sl, H, hd); cos/sin (1, Sl, 1, hd)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)              # (B, Sl, H, hd/2) each
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class SequenceParallelSelfAttention:
    """The self-attention of a Wan/SkyReels block over a sequence sharded across `sp`.

    The projections, q/k RMS norms (per token, across heads) and the rotary embedding
    (this rank's tokens' global positions) run on the local tokens; the attention itself
    is `engine.parallel.sequence_parallel_attention` (Ulysses, Ring or USP).
    """

    def __init__(self, sp: SequenceParallel, seq_len: int, causal: BlockCausal | None):
        self.sp, self.seq_len, self.causal = sp, seq_len, causal

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kw):
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, Sl, H*hd)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))                             # (B, Sl, H, hd)
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        out = sequence_parallel_attention(q, k, v, self.sp, self.seq_len, causal=self.causal)      # (B, Sl, H, hd)
        out = out.flatten(2, 3).type_as(q)                                                          # (B, Sl, H*hd)
        return attn.to_out[1](attn.to_out[0](out))


class _installed:
    """Swap every block's self-attention processor for the duration of a forward."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    def __enter__(self):
        self.saved = [block.attn1.processor for block in self.model.blocks]
        for block in self.model.blocks:
            block.attn1.processor = self.processor

    def __exit__(self, *exc):
        for block, processor in zip(self.model.blocks, self.saved):
            block.attn1.processor = processor


def _embed_local_tokens(model, x: torch.Tensor, start: int, stop: int, frame_tokens: int) -> torch.Tensor:
    """Patch-embed only the frames that hold tokens [start, stop). x (B, C, F, H, W) -> (B, stop-start, D)."""
    p_t = model.config.patch_size[0]
    f0, f1 = start // frame_tokens, -(-stop // frame_tokens)
    emb = model.patch_embedding(x[:, :, f0 * p_t:f1 * p_t])                  # (B, D, f1-f0, h, w)
    emb = emb.flatten(2).transpose(1, 2)                                      # (B, (f1-f0)*h*w, D)
    offset = f0 * frame_tokens
    return emb[:, start - offset:stop - offset].contiguous()


def parallel_forward(model, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                     sp: SequenceParallel, cfg: CfgGroups | None = None, fps: list[int] | None = None,
                     frames_per_block: int = 1) -> torch.Tensor:
    """`WanTransformer3DModel.forward` / `SkyReelsV2Transformer3DModel.forward` over the group.

    x (B, C, F, H, W); timestep (B,), or (B, F) per latent frame (diffusion forcing, SkyReels
    only); text (B, L, C_text) -> (B, C_out, F, H, W) on every rank. `frames_per_block` > 1
    applies SkyReels' block-causal frame mask (diffusion forcing); `fps` the SkyReels fps
    embedding (its `inject_sample_info`).
    """
    if cfg is not None:
        # each half of the workers takes half of the batch, then the pairs join them
        B = x.shape[0]
        half = slice(cfg.index * (B // 2), (cfg.index + 1) * (B // 2))
        out = parallel_forward(model, x[half], timestep[half], text[half], sp, fps=None if fps is None else fps[half],
                               frames_per_block=frames_per_block)                  # (B/2, C_out, F, H, W)
        return comm.all_gather(out, 0, cfg.pair)                                    # (B, C_out, F, H, W)
    if getattr(model.config, "image_dim", None) is not None or getattr(model.config, "added_kv_proj_dim", None):
        raise ValueError("image-conditioned (I2V) Wan checkpoints are not supported: text-to-video only")
    B, C, F, H, W = x.shape
    p_t, p_h, p_w = model.config.patch_size
    f, h, w = F // p_t, H // p_h, W // p_w
    frame_tokens, S = h * w, f * h * w
    pg = sp.pg
    Sl = comm.shard_size(S, pg.world_size)
    start, stop = min(S, pg.rank * Sl), min(S, (pg.rank + 1) * Sl)              # my real tokens
    frame_of = (torch.arange(pg.rank * Sl, (pg.rank + 1) * Sl, device=x.device) // frame_tokens).clamp(max=f - 1)

    cos, sin = model.rope(x)                                                     # (1, S, 1, hd) each
    rotary = tuple(comm.pad_dim(t[:, start:stop], 1, Sl) for t in (cos, sin))   # (1, Sl, 1, hd)
    tokens = comm.pad_dim(_embed_local_tokens(model, x, start, stop, frame_tokens), 1, Sl)  # (B, Sl, D)

    skyreels = hasattr(model.config, "num_frame_per_block")
    if timestep.ndim == 2 and not skyreels:
        raise ValueError("per-token timesteps (Wan 2.2 TI2V's expand_timesteps) are not supported")
    if skyreels:
        temb, proj, text_emb, _ = model.condition_embedder(timestep, text, None)  # (B[,F], D), (B[,F], 6D)
        proj = proj.unflatten(-1, (6, -1))                                        # (B[, F], 6, D)
        if model.config.inject_sample_info:
            fps_ids = torch.tensor(fps, dtype=torch.long, device=x.device)
            extra = model.fps_projection(model.fps_embedding(fps_ids)).unflatten(1, (6, -1))  # (B, 6, D)
            proj = proj + (extra[:, None] if timestep.ndim == 2 else extra)
    else:
        temb, proj, text_emb, _ = model.condition_embedder(timestep, text, None, timestep_seq_len=None)
        proj = proj.unflatten(1, (6, -1))                                         # (B, 6, D)
    if timestep.ndim == 2:                                                        # one timestep per latent frame
        temb = temb[:, frame_of]                                                  # (B, Sl, D)
        proj = proj[:, frame_of].transpose(1, 2).contiguous()                    # (B, 6, Sl, D)

    causal = BlockCausal(frame_tokens, frames_per_block) if frames_per_block > 1 else None
    with _installed(model, SequenceParallelSelfAttention(sp, S, causal)):
        for block in model.blocks:
            if skyreels:
                tokens = block(tokens, text_emb, proj, rotary, None)             # (B, Sl, D)
            else:
                tokens = block(tokens, text_emb, proj, rotary)

    if temb.ndim == 3:                                                            # per token
        shift, scale = (model.scale_shift_table.unsqueeze(2) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift, scale = shift.squeeze(1), scale.squeeze(1)                         # (B, Sl, D)
    else:
        shift, scale = (model.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)  # (B, 1, D)
    tokens = (model.norm_out(tokens.float()) * (1 + scale) + shift).type_as(tokens)
    out = model.proj_out(tokens)                                                  # (B, Sl, p_t*p_h*p_w*C_out)
    out = comm.gather(out, 1, S, pg)                                              # (B, S, p_t*p_h*p_w*C_out)
    out = out.reshape(B, f, h, w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)                          # (B, C_out, F, H, W)


# -- the family: what the video engine drives on each worker ------------------------------------------

#: diffusers' own defaults, per pipeline class (`__call__` signatures), and the fps the models were trained at
PIPELINE_DEFAULTS = {
    "WanPipeline": {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50,
                    "guidance_scale": 5.0, "fps": 16},
    "SkyReelsV2Pipeline": {"height": 544, "width": 960, "num_frames": 97, "num_inference_steps": 50,
                           "guidance_scale": 6.0, "fps": 24},
}
MAX_SEQUENCE_LENGTH = 512            # the prompt length both pipelines pad UMT5's output to


def vae_factors(vae_config: dict) -> tuple[int, int]:
    """(spatial, temporal) compression of an `AutoencoderKLWan` config."""
    down = vae_config.get("temperal_downsample", [False, True, True])
    spatial = vae_config.get("scale_factor_spatial") or 2 ** len(down)
    temporal = vae_config.get("scale_factor_temporal") or 2 ** sum(down)
    return spatial, temporal


def decoded_frames(latent_frames: int, temporal: int) -> int:
    """Pixel frames a causal VAE makes of `latent_frames` (the first latent frame is one frame)."""
    return 0 if latent_frames <= 0 else 1 + (latent_frames - 1) * temporal


@dataclass
class WanRequest(WorkerRequest):
    scheduler: object = None
    timesteps: torch.Tensor = None
    timesteps_cpu: list = None         # the same as floats: scheduling decisions without a device sync
    latents: torch.Tensor = None       # (B, C, F, h, w) float32, identical on every rank
    text: torch.Tensor = None          # (2B or B, 512, C_text): [negative; positive] when CFG
    step_kwargs: dict = None
    decoder: object = None             # the streaming VAE decoder, once decoding started
    latents_decoded: int = 0


class WanFamily(VideoFamily):
    """`WanPipeline` (Wan 2.1; Wan 2.2 with `transformer_2` and `boundary_ratio`) and `SkyReelsV2Pipeline`."""

    name = "wan"
    pipeline_classes = frozenset(PIPELINE_DEFAULTS)
    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"

    @classmethod
    def describe(cls, model_dir: Path) -> dict:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        experts = [name for name in ("transformer", "transformer_2") if (index.get(name) or [None])[0]]
        cfg = read_json(model_dir / experts[0] / "config.json")
        spatial, temporal = vae_factors(read_json(model_dir / "vae" / "config.json"))
        two_experts = len(experts) == 2 and index.get("boundary_ratio") is not None
        if index.get("expand_timesteps"):
            raise ValueError(f"{model_dir}: Wan 2.2 TI2V checkpoints (expand_timesteps) are not supported")
        return {"family": cls.name, "pipeline": index["_class_name"], "heads": cfg["num_attention_heads"],
                "size_multiple": spatial * cfg["patch_size"][1], "frame_multiple": temporal * cfg["patch_size"][0],
                "two_experts": two_experts, "boundary_ratio": index.get("boundary_ratio") if two_experts else None,
                "options": ["guidance_scale_2"] if two_experts else [],
                "defaults": generation_defaults(model_dir, PIPELINE_DEFAULTS[index["_class_name"]])}

    @classmethod
    def check_request(cls, info: dict, spec: GenerationSpec) -> GenerationSpec:
        from engine.families.base import check_common

        check_common(info, spec, tuple(info["options"]))
        if "guidance_scale_2" in spec.options:
            check_number("guidance_scale_2", spec.options["guidance_scale_2"], 0, 100)
        return spec

    def __init__(self, ctx, model_dir: str, plan: ParallelPlan, dtype: torch.dtype, attention: str,
                 vae_tiling: bool = False):
        import diffusers
        import transformers

        super().__init__(ctx, model_dir, plan, dtype, attention, vae_tiling)
        if attention == "xformers":
            raise ValueError("attention='xformers' is not available for the Wan family (it uses PyTorch SDPA)")
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        desc = self.describe(Path(model_dir))
        pipeline_class = getattr(diffusers, desc["pipeline"])
        skip = {} if self.pg.rank == 0 else {"text_encoder": None, "tokenizer": None}
        # the VAE stays in float32 (diffusers' Wan examples load it so); the rest in `dtype`
        pipe = pipeline_class.from_pretrained(model_dir, dtype={"default": dtype, "vae": torch.float32}, **skip)
        pipe.to(self.pg.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe, self.desc = pipe, desc
        self.experts = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
        self.vae_spatial, self.vae_temporal = vae_factors(dict(pipe.vae.config))
        self.boundary = (desc["boundary_ratio"] * pipe.scheduler.config.num_train_timesteps
                         if desc["two_experts"] else None)
        self.cfg_groups = None
        self.set_plan(plan)

    def set_plan(self, plan: ParallelPlan) -> None:
        """Build the worker groups of `plan` (collective: every rank calls it)."""
        pg = self.pg
        if plan.cfg_parallel and pg.world_size > 1:
            self.cfg_groups = make_cfg_groups(pg)
            half = list(range(pg.world_size))
            halves = [half[:len(half) // 2], half[len(half) // 2:]]
            # new_group is collective over the world: build both halves' groups on every rank
            sps = [make_sequence_parallel(self.cfg_groups.half if i == self.cfg_groups.index else None, plan.name,
                                          plan.ulysses_degree, members=m) for i, m in enumerate(halves)]
            self.sp_cfg = sps[self.cfg_groups.index]
        else:
            self.cfg_groups, self.sp_cfg = None, None
        self.sp = make_sequence_parallel(pg, plan.name, plan.ulysses_degree)
        self.plan = plan

    def info(self) -> dict:
        return {"scheduler": type(self.pipe.scheduler).__name__, "attention": "sdpa",
                "experts": len(self.experts), "vae_scale_factor": self.vae_spatial,
                "vae_temporal_factor": self.vae_temporal}

    # -- requests ------------------------------------------------------------------------------

    def _expert(self, t: float) -> int:
        """Wan 2.2: the high-noise expert for t >= boundary, the low-noise one below (index 0 / 1)."""
        return 0 if self.boundary is None or t >= self.boundary else 1

    def _key(self, r: "WanRequest") -> tuple:
        expert = self._expert(r.timesteps_cpu[r.steps_done]) if r.steps_done < r.num_steps else -1
        return ("wan", *r.latents.shape, expert)

    def encode(self, spec: GenerationSpec) -> torch.Tensor:
        """[negative; positive] UMT5 embeddings, zero-padded to 512 tokens as the pipelines do (rank 0 only)."""
        def run():
            with torch.no_grad():
                positive, negative = self.pipe.encode_prompt(
                    prompt=spec.prompt, negative_prompt=spec.negative_prompts(),
                    do_classifier_free_guidance=spec.use_cfg, num_videos_per_prompt=1,
                    max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.pg.device)
            return (torch.cat([negative, positive]) if spec.use_cfg else positive).cpu()   # (2B|B, 512, C_text)

        return self.broadcast_from_first(run).to(self.pg.device, self.dtype)

    def admit(self, spec: GenerationSpec) -> "WanRequest":
        pipe, pg = self.pipe, self.pg
        t0 = time.perf_counter()
        text = self.encode(spec)
        encode_s = time.perf_counter() - t0
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(spec.num_inference_steps, device=pg.device)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        shape = (spec.batch_size, self.experts[0].config.in_channels,
                 (spec.num_frames - 1) // self.vae_temporal + 1,
                 spec.height // self.vae_spatial, spec.width // self.vae_spatial)
        generator = seeded_generator(spec.seed)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(pg.device)  # as prepare_latents
        req = WanRequest(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(), num_frames=spec.num_frames,
                         scheduler=scheduler, timesteps=scheduler.timesteps,
                         timesteps_cpu=scheduler.timesteps.tolist(), latents=latents, text=text,
                         step_kwargs=scheduler_step_kwargs(scheduler, generator))
        req.batch_key = self._key(req)
        req.timings["encode_s"] = encode_s
        return req

    def step(self, reqs: list["WanRequest"]) -> None:
        """One denoising step for a batch (same latent shape and expert), one parallel forward."""
        pg = self.pg
        t0 = time.perf_counter()
        expert = self._expert(reqs[0].timesteps_cpu[reqs[0].steps_done])
        model = self.experts[expert]
        use_cfg_parallel = self.cfg_groups is not None and all(r.spec.use_cfg for r in reqs)
        rows = []
        for r in reqs:
            x = torch.cat([r.latents] * (2 if r.spec.use_cfg else 1)).to(self.dtype)  # (2B|B, C, F, h, w)
            rows.append([x, r.timesteps[r.steps_done].reshape(1).expand(x.shape[0]), r.text])
        inputs, times, texts = order_rows(rows, use_cfg_parallel)
        with torch.no_grad():
            noise = parallel_forward(model, torch.cat(inputs), torch.cat(times).to(pg.device), torch.cat(texts),
                                     self.sp_cfg if use_cfg_parallel else self.sp,
                                     cfg=self.cfg_groups if use_cfg_parallel else None)  # (rows, C, F, h, w)
        per_req = split_rows(noise, [len(x) for x, _, _ in rows], use_cfg_parallel)
        with torch.no_grad():
            for r, out in zip(reqs, per_req):
                scale = r.spec.guidance_scale if expert == 0 else r.spec.options.get("guidance_scale_2",
                                                                                        r.spec.guidance_scale)
                pred = guided(out, r.spec.use_cfg, scale)
                t = r.timesteps[r.steps_done]
                r.latents = r.scheduler.step(pred, t, r.latents, **r.step_kwargs, return_dict=False)[0]
                r.steps_done += 1
                r.batch_key = self._key(r)
        sync_cuda()  # one wait per step (not per request): the step's kernels count in its time
        elapsed = time.perf_counter() - t0
        for r in reqs:
            r.timings["transformer_s"] += elapsed / len(reqs)

    # -- decoding ----------------------------------------------------------------------------------

    def unnormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipelines' `latents / (1 / std) + mean`, in the VAE's dtype."""
        vae = self.pipe.vae
        z = vae.config.z_dim
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean

    def start_decoder(self, latents: torch.Tensor):
        """A streaming decoder for videos shaped like `latents` (B, C, k, h, w): untiled, as diffusers' Wan
        pipelines decode, or in diffusers' default tiles (`vae.enable_tiling()`) with `vae_tiling`."""
        from engine.causal_vae import StreamingVAEDecoder, VAETiling

        B, _, _, h, w = latents.shape
        return StreamingVAEDecoder(self.pipe.vae, self.pg, B, h, w, tiling=VAETiling() if self.vae_tiling else None)

    def decode_latents(self, r: "WanRequest", latents: torch.Tensor):
        """Push the next latent frames (B, C, k, h, w) through the request's streaming decoder (collective);
        rank 0 gets pixels (B, n, H, W, 3) as the spec's output asks."""
        if r.decoder is None:
            r.decoder = self.start_decoder(latents)
        with torch.no_grad():
            video = r.decoder.decode(self.unnormalize(latents))                  # (B, 3, n, H, W) on rank 0
        r.latents_decoded += latents.shape[2]
        return None if video is None else to_pixels(video, self.pipe.video_processor, r.spec.output)

    def decode_next(self, r: "WanRequest", max_frames: int) -> dict | None:
        """The next latent frames whose pixels fit in `max_frames` (at least one), decoded across the workers."""
        start = r.decoded_frames
        if r.spec.output == "latent":
            r.decoded_frames = r.num_frames
            return {"frames": r.latents.cpu(), "start": 0, "stop": r.num_frames, "vae_s": 0.0} \
                if self.pg.rank == 0 else None
        total_latents = r.latents.shape[2]
        k = 1
        while (r.latents_decoded + k < total_latents and
               decoded_frames(r.latents_decoded + k + 1, self.vae_temporal) - start <= max_frames):
            k += 1
        vae_before = r.timings["vae_s"]
        with Timer(r.timings, "vae_s"):
            frames = self.decode_latents(r, r.latents[:, :, r.latents_decoded:r.latents_decoded + k])
        r.decoded_frames = decoded_frames(r.latents_decoded, self.vae_temporal)
        if r.latents_decoded == total_latents and r.decoder is not None:
            r.decoder.close()
            r.decoder = None
        if frames is None:
            return None
        return {"frames": frames, "start": start, "stop": r.decoded_frames, "vae_s": r.timings["vae_s"] - vae_before}


FAMILY = WanFamily

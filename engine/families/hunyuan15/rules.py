"""HunyuanVideo-1.5's coordinator side: what a checkpoint is (from its JSON configs) and what a request may ask.

A dual-stream full-attention video DiT with two text encoders (Qwen2.5-VL's text model, and ByT5 for the glyphs a
prompt quotes), sharded on its F x H x W video tokens (`plan.py`: Ulysses, Ring or USP; CFG-parallel around them).

Image-to-video: the image is resized and centre-cropped to the request's height x width (diffusers' rule).
diffusers' pipeline picks the size itself, the bucket of the checkpoint's `target_size` nearest the image's aspect
ratio; longserve takes the request's (default: the checkpoint's), so a request at that bucket's size is diffusers'
call.
"""

from __future__ import annotations

from pathlib import Path

from longserve.engine.config import REQUIRED, ModelDescription
from longserve.engine.families.rules import (
    FamilyRules,
    check_common,
    check_image_input,
    generation_defaults,
    read_json,
)
from longserve.engine.request import GenerationSpec


class Hunyuan15Rules(FamilyRules):
    """`HunyuanVideo15Pipeline` (text-to-video) and `HunyuanVideo15ImageToVideoPipeline` checkpoints."""

    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    #: diffusers' `__call__` defaults (its default size is the 16:9 bucket of the transformer's target_size)
    pipeline_defaults = {"height": 480, "width": 848, "num_frames": 121, "num_inference_steps": 50,
                         "guidance_scale": 6.0, "fps": 24}
    dispatcher_attention = True           # attention_backend: diffusers' processors and our joint attention
    attention_masks = True                # the joint attention masks the prompt's padding

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        cfg = read_json(model_dir / "transformer" / "config.json")
        vae = read_json(model_dir / "vae" / "config.json")
        i2v = index["_class_name"] == "HunyuanVideo15ImageToVideoPipeline"
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=vae.get("spatial_compression_ratio", 16) * cfg.get("patch_size", 1),
            frame_multiple=vae.get("temporal_compression_ratio", 4) * cfg.get("patch_size_t", 1),
            defaults=generation_defaults(model_dir, cls.pipeline_defaults), options=("image",) if i2v else (),
            capabilities=cls.capabilities((), image=REQUIRED) if i2v else cls.capabilities(()))

    @classmethod
    def resolve_plan(cls, desc: ModelDescription, parallel: str, workers: int, ulysses_degree: int | None = None,
                     cfg_parallel: bool = False):
        """"auto" is Ulysses at every worker count: heads fewer than the group are zero-padded, and one all-to-all
        pair per block sends less than a ring (the generic rule would pick USP or Ring where the heads do not
        cover the group)."""
        return super().resolve_plan(desc, "ulysses" if parallel == "auto" else parallel, workers, ulysses_degree,
                                    cfg_parallel)

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        check_image_input(desc, spec, "HunyuanVideo15ImageToVideoPipeline")
        check_common(desc, spec)
        return spec

"""HunyuanVideo-1.5, declared (engine/families/declaration.py). Its checkpoints are its line of the family table."""

from longserve.engine.families.declaration import Family
from longserve.engine.families.hunyuan15.rules import Hunyuan15Rules

FAMILY = Family("hunyuan15", rules=Hunyuan15Rules,
                encoder=".worker:Hunyuan15Encoder",             # Qwen2.5-VL + ByT5 prompts, the image (rank 0)
                denoiser=".plan:Hunyuan15SequenceParallel",     # HUNYUAN15_PLAN over diffusers' transformer
                loop=".worker:Hunyuan15Loop",                   # latents and condition channels, the generic step
                decoder=".vae:Hunyuan15VAE")                    # the VAE streamed in time

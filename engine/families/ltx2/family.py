"""LTX-2, declared (engine/families/declaration.py). Its checkpoints are its line of the family table."""

from longserve.engine.families.declaration import Family
from longserve.engine.families.ltx2.rules import LTX2Rules

FAMILY = Family("ltx2", rules=LTX2Rules,
                encoder=".worker:LTX2Encoder",              # Gemma 3 through the text connectors, the first frame
                denoiser=".plan:LTX2SequenceParallel",      # LTX2_PLAN: video tokens split, audio replicated
                loop=".worker:LTX2Loop",                    # LTX-2's guidance (CFG, STG, modality), two stages
                decoder=".vae:LTX2VAE")                     # the video VAE windowed in time, the sound first

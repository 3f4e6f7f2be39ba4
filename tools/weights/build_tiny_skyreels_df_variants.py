"""Write ``weights/tiny-skyreels-df-i2v`` and ``weights/tiny-skyreels-df-v2v``: the trained ``tiny-skyreels-df``
as a ``SkyReelsV2DiffusionForcingImageToVideoPipeline`` and a ``SkyReelsV2DiffusionForcingVideoToVideoPipeline``
directory.

Usage::

    python -m tools.weights.build_tiny_skyreels_df_variants                  # (re)writes both shipped dirs
    python -m tools.weights.build_tiny_skyreels_df_variants --kind v2v --out DIR

The three diffusion-forcing pipelines of diffusers take the same components (tokenizer, UMT5 text encoder,
``SkyReelsV2Transformer3DModel``, ``AutoencoderKLWan``, scheduler), and diffusers' own examples load the one
published DF checkpoint into each. A directory saved from the I2V or the V2V pipeline differs from it only by
the ``_class_name`` of its ``model_index.json``, which is what longserve serves it by: the I2V one needs an
image, the V2V one a video to extend (``engine/families/skyreels_df.py``), where ``tiny-skyreels-df`` takes
either or neither. So each variant is ``tiny-skyreels-df`` itself, not a copy: its ``model_index.json``
(the class name changed, the version stamp kept), its own ``generation_defaults.json``, and, for every
component, a relative symbolic link to ``../tiny-skyreels-df/<component>`` (a few hundred bytes in all; git
and the Docker image keep the links; a wheel holds copies). Nothing is drawn at random: the build is the same
bytes every time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS
from tools.weights.writing import write_whole

SOURCE = "tiny-skyreels-df"
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
CLASSES = {"i2v": "SkyReelsV2DiffusionForcingImageToVideoPipeline",
           "v2v": "SkyReelsV2DiffusionForcingVideoToVideoPipeline"}
KINDS = tuple(CLASSES)
DEFAULT_OUT = {kind: TINY_MODELS[f"{SOURCE}-{kind}"] for kind in KINDS}
#: tiny-skyreels-df's call defaults, but for V2V: 25 frames are the 9 (overlap_history) that re-make the input's
#: end and 16 new ones, in 2 segments of 17 (base_num_frames), i.e. 2 s at 8 fps
GENERATION_DEFAULTS = {"i2v": {}, "v2v": {"num_frames": 25}}


def write(kind: str, out_dir: Path) -> None:
    source = TINY_MODELS[SOURCE]
    index = json.loads((source / "model_index.json").read_text())
    index["_class_name"] = CLASSES[kind]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    defaults = {**json.loads((source / GENERATION_DEFAULTS_FILE).read_text()), **GENERATION_DEFAULTS[kind]}
    (out_dir / GENERATION_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")
    for name in COMPONENTS:
        os.symlink(f"../{SOURCE}/{name}", out_dir / name, target_is_directory=True)
    for path in (out_dir / "model_index.json", out_dir / GENERATION_DEFAULTS_FILE):
        path.chmod(0o644)
    out_dir.chmod(0o755)


def build(kind: str, out: str | Path | None = None) -> Path:
    """Write the ``kind`` ("i2v" or "v2v") directory at ``out`` (default: the shipped one), through a temporary
    sibling swapped in at the end. Its links point at a ``tiny-skyreels-df`` beside it: elsewhere they dangle
    (the digest test compares them as links)."""
    if kind not in CLASSES:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return write_whole(DEFAULT_OUT[kind] if out is None else out, lambda tmp: write(kind, tmp), resolve=False,
                       normalise=False)


def entries(root: Path) -> dict[str, str]:
    """What a variant directory holds: file name -> its text, link name -> "-> target"."""
    return {p.name: f"-> {os.readlink(p)}" if p.is_symlink() else p.read_text() for p in sorted(Path(root).iterdir())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_skyreels_df_variants",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=KINDS, default=None, help="one of them (default: both)")
    ap.add_argument("--out", default=None, help="output directory (with --kind; default: the shipped one)")
    args = ap.parse_args(argv)
    if args.out is not None and args.kind is None:
        ap.error("--out needs --kind")
    for kind in (args.kind,) if args.kind else KINDS:
        out = build(kind, args.out)
        print(json.dumps({"kind": kind, "out": str(out), "entries": sorted(entries(out))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

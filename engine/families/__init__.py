"""Model families, found in the one family table (engine/family_index.py): by a checkpoint's `model_index.json`
`_class_name`, or by what a claiming family's line names.

A family's module (a package `engine/families/<name>/` with `family.py`, or one module) defines `FAMILY`: a `Family`
declaration (engine/families/declaration.py) or a `VideoFamily` subclass, which enters as `Family.of_class`. Adding
a family is adding its package (and its tests) and its line in the table: the scheduler, the server and the CLI never
name one.
"""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path

from longserve.engine.families.declaration import Family
from longserve.engine.family_index import CLAIMS, FAMILIES, PIPELINE_FAMILIES, hinted, model_index

#: transformers' image processors a checkpoint may name (model_index.json: Wan I2V's CLIP, Helios' SigLIP)
IMAGE_PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor")


@cache
def pil_image_processors() -> None:
    """Without torchvision, transformers serves `CLIPImageProcessor` as `CLIPImageProcessorPil` (the same
    processing, PIL's) and warns on every run ("requires torchvision ... falling back"), even for models that
    never load one. The engine asks for the PIL class by its own name and puts it where the checkpoint's name
    finds it (as transformers' fallback does), so nothing is printed."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return
    import sys

    import transformers

    for name in IMAGE_PROCESSORS:
        pil = getattr(transformers, f"{name}Pil", None)
        if pil is not None:       # (transformers' first attribute access may put another module object in sys.modules)
            for module in {id(m): m for m in (transformers, sys.modules["transformers"])}.values():
                setattr(module, name, pil)


@cache
def load_family(name: str) -> Family:
    """The family the table names `name`, its module imported now (and only it)."""
    pil_image_processors()
    family = importlib.import_module(f"{__name__}.{FAMILIES[name].module}").FAMILY
    return family if isinstance(family, Family) else Family.of_class(family)


def all_families() -> tuple[Family, ...]:
    """Every family in the table, each imported."""
    return tuple(sorted((load_family(name) for name in FAMILIES), key=lambda f: f.name))


def family_for(pipeline_class: str) -> Family:
    """The family that serves checkpoints whose `model_index.json` names `pipeline_class`."""
    if pipeline_class in PIPELINE_FAMILIES:
        return load_family(PIPELINE_FAMILIES[pipeline_class])
    raise ValueError(f"no model family serves {pipeline_class!r} checkpoints; supported pipelines: "
                     f"{', '.join(sorted(PIPELINE_FAMILIES))}")


def detect_family(model_dir: str | Path) -> Family:
    """The family of a checkpoint directory: one that claims the directory by what its table line names (a causal
    model's `causal_config.json`), else the one serving its `model_index.json`'s `_class_name` (refused, naming
    the ones there are, when no family serves it). Only the families that can answer are imported."""
    model_dir = Path(model_dir)
    index = model_index(model_dir)
    for name, hint in CLAIMS.items():
        if hinted(model_dir, index, hint) and (family := load_family(name)).claims(model_dir):
            return family
    return family_for(index.get("_class_name", "?"))

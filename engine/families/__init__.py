"""Model families: one module each in this package, found by the `_class_name` of a checkpoint's `model_index.json`.

A family module defines `FAMILY`, a subclass of `engine.families.base.VideoFamily`.
Adding a family is adding a module here (and its tests): the scheduler, the server and
the CLI never name one.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path

from longserve.engine.families.base import VideoFamily
from longserve.engine.family_index import CLAIMS, PIPELINE_MODULES, hinted, model_index

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
def all_families() -> tuple[type[VideoFamily], ...]:
    pil_image_processors()
    found = []
    for module in pkgutil.iter_modules(__path__):
        if module.name == "base":
            continue
        family = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if family is not None:
            found.append(family)
    return tuple(sorted(found, key=lambda f: f.name))


def family_for(pipeline_class: str) -> type[VideoFamily]:
    """The family that serves checkpoints whose `model_index.json` names `pipeline_class`."""
    for family in all_families():
        if pipeline_class in family.pipeline_classes:
            return family
    known = sorted(c for f in all_families() for c in f.pipeline_classes)
    raise ValueError(f"no model family serves {pipeline_class!r} checkpoints; supported pipelines: "
                     f"{', '.join(known)}")


def _family_module(name: str) -> type[VideoFamily]:
    pil_image_processors()
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def detect_family(model_dir: str | Path) -> type[VideoFamily]:
    """The family of a checkpoint directory: one that claims the directory by a file of its own (a causal
    model's `causal_config.json`), else the one serving its `model_index.json`'s `_class_name`. Only the
    families that can answer are imported (`CLAIMS`, `PIPELINE_MODULES`); a `_class_name` the table does not
    know is looked for in every family (and refused, naming the ones there are)."""
    from longserve.engine.families.base import read_json

    model_dir = Path(model_dir)
    index_path = model_dir / "model_index.json"
    index = model_index(model_dir)
    class_name = index.get("_class_name", "?")
    for module, hint in CLAIMS.items():
        if hinted(model_dir, index, hint) and (family := _family_module(module)).claims(model_dir):
            return family
    if class_name in PIPELINE_MODULES:
        return _family_module(PIPELINE_MODULES[class_name])
    for family in all_families():       # not in the table: a family's own claim, or the refusal naming them all
        if family.claims(model_dir):
            return family
    return family_for(read_json(index_path).get("_class_name", "?"))

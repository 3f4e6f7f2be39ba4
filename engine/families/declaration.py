"""A model family, declared: `Family(name, rules=..., encoder=..., denoiser=..., loop=..., decoder=...)`.

    FAMILY = Family("hunyuan15", rules=Hunyuan15Rules,                 # coordinator: describe, checks, costs
                    encoder=".worker:Hunyuan15Encoder",                # rank 0's prompt and image encodings
                    denoiser=".plan:Hunyuan15SequenceParallel",        # the sharded forward over a shard plan
                    loop=".worker:Hunyuan15Loop",                      # latents, rows, the scheduler's steps
                    decoder=".vae:Hunyuan15VAE")                       # the VAE path the frame stream calls

The coordinator side is `rules`, a `FamilyRules` class (engine/families/rules.py): importing a declaration imports
no model code, no diffusers and no worker side. The worker side is composed of the parts the declaration names,
each "module:Class" relative to the declaring package and imported on the workers alone (`engine/families/
composed.py` puts them together; CFG-parallel is put around any denoiser by the worker, `VideoFamily.denoise`).
The checkpoints a family serves are its line of the one family table (engine/family_index.py).

Families still written as one `VideoFamily` subclass enter the table through `Family.of_class`: the class is then
both the rules and the worker.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from longserve.engine.families.rules import FamilyRules
from longserve.engine.family_index import FAMILIES

PARTS = ("encoder", "denoiser", "loop", "decoder")


@dataclass(frozen=True)
class Family:
    """A family: its name, its coordinator side (`rules`) and its worker side (the four parts, or a class-based
    family's `worker` class). Asked anything else, it answers with its rules (`family.describe(model_dir)`,
    `family.check_request(desc, spec)`, `family.plans`, ...); called, it builds its worker on this process."""

    name: str
    rules: type[FamilyRules]
    encoder: str = ""
    denoiser: str = ""
    loop: str = ""
    decoder: str = ""
    worker: type | None = None           # a class-based family (`of_class`): its class
    package: str = ""                    # where the parts' relative module names start (the rules' package)

    def __post_init__(self):
        if self.worker is None:
            missing = [p for p in PARTS if not getattr(self, p)]
            if missing:
                raise ValueError(f"family {self.name!r} declares no {', '.join(missing)}")
            object.__setattr__(self, "package", self.package or self.rules.__module__.rsplit(".", 1)[0])
            # the name and the checkpoints served are the table's line: the rules answer with them
            self.rules.name = self.name
            self.rules.pipeline_classes = frozenset(FAMILIES[self.name].pipelines)

    @classmethod
    def of_class(cls, family_class: type) -> "Family":
        """A family written as one `VideoFamily` subclass (its rules and its worker)."""
        return cls(family_class.name, family_class, worker=family_class)

    def __getattr__(self, attribute: str):
        if attribute.startswith("_") or attribute in ("rules", "worker"):
            raise AttributeError(attribute)        # (unpickling and copying ask before the fields exist)
        return getattr(self.rules, attribute)

    def part(self, which: str):
        """A part the declaration names, imported now (on a worker)."""
        module, _, name = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module, self.package), name)

    def __call__(self, ctx, config):
        """The family's worker on this process (`engine.worker.setup_worker`)."""
        if self.worker is not None:
            return self.worker(ctx, config)
        from longserve.engine.families.composed import ComposedFamily

        return ComposedFamily(ctx, config, self)

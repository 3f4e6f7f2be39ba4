"""The one family table (engine/family_index.py): a process imports its model's family alone, so each line must
say what its family says, every family must have a line (no second way to find one), and a checkpoint finds the
family that serves it."""

import ast
from pathlib import Path

import pytest

from longserve.engine import families
from longserve.engine.families.rules import FamilyRules
from longserve.engine.family_index import FAMILIES
from longserve.weights import TINY_MODELS

PACKAGE = Path(families.__file__).parent


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_table_line_names_its_family_s_pipelines_and_claim(name):
    family = families.load_family(name)
    assert family.name == name
    assert family.pipeline_classes == frozenset(FAMILIES[name].pipelines)
    claims = getattr(family.claims, "__func__", None) is not FamilyRules.claims.__func__
    assert claims == (FAMILIES[name].claim is not None)


def test_every_module_that_defines_a_family_has_a_line_in_the_table():
    """Read without importing: a `FAMILY = ...` anywhere under engine/families/ is a table line's module."""
    defining = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "FAMILY" for t in n.targets)
               for n in tree.body):
            defining.add(".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    assert defining == {entry.module for entry in FAMILIES.values()}


def test_a_declared_family_s_coordinator_side_imports_no_model_code():
    """Importing the declarations (and asking their rules) loads neither the worker side, nor a shard plan, nor
    diffusers: the coordinator's questions are JSON reads."""
    import subprocess
    import sys

    code = ("import sys; from longserve.engine import families; "
            "from longserve.weights import resolve_model; "
            "[families.load_family(n).describe(resolve_model(m)) for n, m in "
            "(('hunyuan15', 'tiny-hunyuan15'), ('ltx2', 'tiny-ltx2'))]; "
            "print(sorted(m for m in sys.modules if m.startswith(('diffusers', 'longserve.engine.families.base', "
            "'longserve.engine.models', 'longserve.engine.families.hunyuan15.', 'longserve.engine.families.ltx2.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["longserve.engine.families.hunyuan15.family", "longserve.engine.families.hunyuan15.rules",
                         "longserve.engine.families.ltx2.family", "longserve.engine.families.ltx2.rules"]


def test_cfg_parallel_is_put_around_a_denoiser_in_one_place():
    """`VideoFamily.denoise` is the one caller of `cfg_parallel` (Latte's hand-written DSP forward, which takes its
    halves' process group rather than a sequence-parallel group, the one other); no family picks `sp_cfg` itself."""
    engine = PACKAGE.parent
    callers = set()
    for path in [*PACKAGE.rglob("*.py"), *(engine / "models").glob("*.py")]:
        text = path.read_text()
        assert "sp_cfg if" not in text, path
        if "cfg_parallel(" in text.replace("def cfg_parallel(", ""):
            callers.add(path.relative_to(engine).as_posix())
    assert callers == {"families/base.py", "models/latte.py"}


def test_diffusers_pipeline_internals_are_called_from_one_adapter_per_family():
    """A call into a diffusers pipeline's private members (`pipe._pack_latents`, ...) is written in the family's
    `pipeline_api.py` alone, so that an upgrade of diffusers that changes one breaks one module."""
    import re

    private = re.compile(r"\bpipe(?:line)?\._[a-z]")
    engine = PACKAGE.parent
    for path in engine.rglob("*.py"):
        if path.name != "pipeline_api.py":
            assert not private.search(path.read_text()), path
    assert private.search((PACKAGE / "ltx2" / "pipeline_api.py").read_text())


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_the_table_finds_the_family_that_serves_each_shipped_checkpoint(name):
    path = Path(TINY_MODELS[name])
    if not (path / "model_index.json").is_file():
        pytest.skip(f"{name} is not a video checkpoint")
    claiming = [f for f in families.all_families() if f.claims(path)]
    class_name = families.model_index(path)["_class_name"]
    expected = claiming[0] if claiming else next(f for f in families.all_families()
                                                  if class_name in f.pipeline_classes)
    assert families.detect_family(path) is expected


def test_a_pipeline_no_family_serves_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ValueError, match="no model family serves 'FluxPipeline'.*LattePipeline"):
        families.detect_family(tmp_path)

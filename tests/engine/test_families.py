"""The families' lookup table (engine/families/__init__.py): a process imports its model's family alone, so the
table must say what the families themselves say."""

from pathlib import Path

import pytest

from longserve.engine import families
from longserve.weights import TINY_MODELS


def test_the_table_names_every_family_s_pipeline_classes_and_every_claiming_family():
    derived = {c: f.__module__.rsplit(".", 1)[1] for f in families.all_families() for c in f.pipeline_classes}
    assert families.PIPELINE_MODULES == derived
    claiming = {f.__module__.rsplit(".", 1)[1] for f in families.all_families()
                if f.claims.__func__ is not families.VideoFamily.claims.__func__}
    assert set(families.CLAIMS) == claiming


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_the_fast_lookup_finds_the_family_that_claims_each_shipped_checkpoint(name):
    path = Path(TINY_MODELS[name])
    if not (path / "model_index.json").is_file():
        pytest.skip(f"{name} is not a video checkpoint")
    scanned = next((f for f in families.all_families() if f.claims(path)), None)
    if scanned is None:
        scanned = families.family_for(families.base.read_json(path / "model_index.json")["_class_name"])
    assert families.detect_family(path) is scanned


def test_a_pipeline_no_family_serves_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ValueError, match="no model family serves 'FluxPipeline'.*LattePipeline"):
        families.detect_family(tmp_path)

"""tiny-skyreels-df-i2v and tiny-skyreels-df-v2v: the trained tiny-skyreels-df under the class names of diffusers'
DF image-to-video and video-to-video pipelines, rebuilt byte for byte by their script, a few hundred bytes of
their own (links to tiny-skyreels-df's components), and loadable by diffusers as those pipelines."""

import json

import pytest

from longserve.weights import TINY_MODELS, pipeline_class, resolve_model
from tools.weights import build_tiny_skyreels_df_variants

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", build_tiny_skyreels_df_variants.KINDS)
def test_the_build_equals_the_committed_directory_byte_for_byte(tmp_path, kind):
    built = build_tiny_skyreels_df_variants.build(kind, tmp_path / f"tiny-skyreels-df-{kind}")
    shipped = TINY_MODELS[f"tiny-skyreels-df-{kind}"]
    assert build_tiny_skyreels_df_variants.entries(built) == build_tiny_skyreels_df_variants.entries(shipped)


def test_the_variants_are_tiny_skyreels_df_under_the_other_pipeline_classes():
    from diffusers import DiffusionPipeline

    source = resolve_model("tiny-skyreels-df")
    index = json.loads((source / "model_index.json").read_text())
    for kind, cls in build_tiny_skyreels_df_variants.CLASSES.items():
        root = resolve_model(f"tiny-skyreels-df-{kind}")
        assert pipeline_class(root) == cls
        assert {k: v for k, v in json.loads((root / "model_index.json").read_text()).items()
                if k != "_class_name"} == {k: v for k, v in index.items() if k != "_class_name"}
        own = [p for p in root.iterdir() if not p.is_symlink()]
        assert sum(p.stat().st_size for p in own) < 2048, "nothing but the index and the call defaults"
        for name in build_tiny_skyreels_df_variants.COMPONENTS:
            assert (root / name).is_symlink() and (root / name).resolve() == source / name
    pipe = DiffusionPipeline.from_pretrained(str(resolve_model("tiny-skyreels-df-v2v")))
    assert type(pipe).__name__ == "SkyReelsV2DiffusionForcingVideoToVideoPipeline"

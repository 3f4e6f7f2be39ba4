"""Prompt timelines for finite long video (engine/timeline.py): on the trained tiny-skyreels-df a two-prompt timeline
draws the first prompt's colour in the segments before the switch and the second's after (the switch on a segment
boundary), each distinct prompt is encoded once, bad timelines are refused naming the entry's field, and a family
that makes one segment refuses the option naming it."""

import numpy as np
import pytest
from content import describe, segment_starts

from longserve.engine.request import GenerationSpec, RequestError
from longserve.engine.timeline import check_timeline, distinct_prompts, segment_prompts
from longserve.weights import resolve_model

RED, BLUE = "a red ball bouncing", "a blue ball bouncing"


def spec(prompts, num_frames=41, **options):
    return GenerationSpec(request_id="t", prompt=["ignored"], negative_prompt="", num_frames=num_frames, height=64,
                          width=64, num_inference_steps=2, guidance_scale=1.0, seed=0,
                          options={"prompts": prompts, **options}, fps=8)


def test_each_segment_takes_the_prompt_of_its_first_new_frame_and_repeats_share_an_encoding():
    s = check_timeline(spec([{"prompt": RED, "seconds": 2}, {"prompt": BLUE, "seconds": 2}, {"prompt": RED}], 65),
                       fps=8)
    assert s.prompt == [RED] and distinct_prompts(s) == [RED, BLUE]
    # segments start at frames 0, 17, 25, 33, 41, 49, 57: red before 16 (2 s at 8 fps), blue before 32, red after
    assert segment_prompts(s, segment_starts(65, 17, 9), fps=8) == [0, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("prompts, field", [
    ([], "prompts"),
    ("a red ball", "prompts"),
    ([{"prompt": RED}, {"prompt": BLUE}], "prompts[0].seconds"),          # only the last may run to the end
    ([{"prompt": RED, "seconds": 0}], "prompts[0].seconds"),
    ([{"prompt": "", "seconds": 1}], "prompts[0].prompt"),
    ([{"prompt": RED, "seconds": 9}, {"prompt": BLUE}], "prompts[1].seconds"),   # starts after the video's 5.1 s
    ([{"prompt": RED, "second": 1}], "prompts[0].second"),
    (["a red ball"], "prompts[0]"),
])
def test_bad_timelines_are_refused_naming_the_entry_and_field(prompts, field):
    with pytest.raises(RequestError) as e:
        check_timeline(spec(prompts), fps=8)
    assert e.value.field == field


@pytest.mark.parametrize("model", ["tiny-sana-video", "tiny-ltx2", "tiny-wan"])
def test_a_family_that_makes_one_segment_refuses_a_timeline_naming_the_field(model):
    from longserve.engine.families import detect_family

    rules = detect_family(resolve_model(model)).rules
    desc = rules.describe(resolve_model(model))
    s = spec([{"prompt": RED}], num_frames=9)
    s.height = s.width = 96
    with pytest.raises(RequestError) as e:
        rules.check_request(desc, s)
    assert e.value.field == "prompts" and "timeline" in str(e.value), e.value


def test_two_prompt_timeline_on_tiny_skyreels_df_draws_each_prompts_colour_on_its_side_of_the_switch():
    """41 frames in segments starting at 0, 17, 25, 33; red for 3 s (24 frames at 8 fps): the first two segments
    red, the next two (whose first new frames come after 3 s) blue. Without the timeline every segment is red
    (tests/pipelines/test_long_content.py), so the test fails if the second prompt is ignored."""
    from longserve.pipelines import VideoPipeline

    timeline = [{"prompt": RED, "seconds": 3}, {"prompt": BLUE}]
    with VideoPipeline.from_pretrained("tiny-skyreels-df", workers=1, device="cpu") as pipe:
        video = pipe(RED, prompts=timeline, num_frames=41, seed=0).frames[0]
    starts = segment_starts(41, 17, 9)
    assert starts == [0, 17, 25, 33]
    colours = [describe(np.asarray(video[a:b])).colour for a, b in zip(starts, starts[1:] + [41])]
    assert colours == ["red", "red", "blue", "blue"], colours


def test_the_cli_takes_a_timeline_as_an_option_and_names_a_bad_entry_before_loading(tmp_path, capsys):
    import imageio.v3 as iio

    from longserve.server.cli import main

    out = tmp_path / "switch.mp4"
    base = ["generate", RED, "--model", "tiny-skyreels-df", "--workers", "1", "--device", "cpu", "--frames", "25",
            "--steps", "1", "--seed", "0", "-o", str(out)]
    assert main(base + ["--opt", 'prompts=[{"prompt": "a red ball bouncing"}, {"prompt": "b"}]']) != 0
    assert "--opt prompts[0].seconds" in capsys.readouterr().err
    assert main(base + ["--opt", f'prompts=[{{"prompt": "{RED}", "seconds": 2}}, {{"prompt": "{BLUE}"}}]']) == 0
    assert iio.imread(out, extension=".mp4").shape == (25, 64, 64, 3)


def test_helios_takes_each_chunks_prompt_from_the_timeline_and_the_chunks_before_the_switch_are_unchanged():
    """tiny-helios (random weights: no colours to read) makes 33-frame chunks at 24 fps: with A for 1 s then B, the
    first chunk (frames 0-32, starting at 0 s) is A's run exactly and the second (starting at 33 / 24 = 1.4 s) is
    conditioned on B, so it differs from A's run."""
    from longserve.pipelines import VideoPipeline

    kw = dict(num_frames=66, num_inference_steps=2, guidance_scale=5.0, seed=0)
    with VideoPipeline.from_pretrained("tiny-helios", workers=1, device="cpu") as pipe:
        plain = pipe("a red ball", **kw).frames[0]
        switched = pipe("a red ball", prompts=[{"prompt": "a red ball", "seconds": 1}, {"prompt": "a blue square"}],
                        **kw).frames[0]
    assert plain.shape == switched.shape and len(plain) == 65
    assert np.abs(switched[:33] - plain[:33]).max() == 0
    assert np.abs(switched[33:] - plain[33:]).max() > 0.01


def test_framepack_takes_each_sections_prompt_from_the_timeline():
    """tiny-framepack, vanilla sampling, windows of 2 latent frames at 30 fps: section 0's frames start at 0 s, section
    1's at 9 / 30 = 0.3 s. With A for 0.2 s then B, the frames section 0 alone makes (its first 4) are A's run
    exactly and the rest, which section 1 (conditioned on B) makes or blends, differ."""
    import PIL.Image

    from longserve.pipelines import VideoPipeline

    img = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    kw = dict(image=img, height=32, width=32, num_frames=9, latent_window_size=2, num_inference_steps=2, seed=0,
              sampling_type="vanilla")
    with VideoPipeline.from_pretrained("tiny-framepack", workers=1, device="cpu") as pipe:
        plain = pipe("a red ball", **kw).frames[0]
        switched = pipe("a red ball", prompts=[{"prompt": "a red ball", "seconds": 0.2},
                                               {"prompt": "a blue square"}], **kw).frames[0]
    assert plain.shape == switched.shape == (17, 32, 32, 3)
    assert np.abs(switched[:4] - plain[:4]).max() == 0
    assert np.abs(switched[4:] - plain[4:]).max() > 0.01

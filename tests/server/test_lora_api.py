"""LoRA adapters and the few-step schedule at the front doors: the `lora` field of POST /v1/videos (JSON as the
openai client sends `extra_body`, and multipart form text), reported back in the video's JSON; an unknown adapter
or a bad scale is a 400 naming `lora`; `--lora NAME=PATH[:SCALE]` on the command line."""

import argparse
import warnings

import httpx
import imageio.v3 as iio
import pytest
from servers import serving

from longserve.engine.config import EngineConfig, add_cli_args, from_cli_args
from longserve.engine.lora import LoraAdapter
from longserve.server.cli import main

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the openai client marks the Sora API deprecated

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lora_per_request_over_http_with_the_openai_client_and_a_form(tmp_path):
    from openai import OpenAI

    with serving(tmp_path, model="tiny-wan", workers=1, default_steps=2, score_model="none",
                 loras=("style=tiny-wan-lora:0.5", "musubi=tiny-wan-lora-musubi")) as s:
        client = OpenAI(base_url=s["url"] + "/v1", api_key="unused", max_retries=0)
        extra = {"fps": 1, "seed": 3, "guidance_scale": 1.0, "sigmas": [1.0, 0.5],
                 "lora": [{"name": "style"}, {"name": "musubi", "scale": 0.25}]}
        video = client.videos.create(prompt="a red ball", size="48x32", seconds="1", extra_body=extra)
        assert video.model_extra["lora"] == [{"name": "style", "scale": 0.5}, {"name": "musubi", "scale": 0.25}]
        assert video.model_extra["num_inference_steps"] == 2 and video.model_extra["options"]["sigmas"] == [1.0, 0.5]
        done = client.videos.poll(video.id, poll_interval_ms=50)
        assert done.status == "completed", done.error
        assert done.model_extra["lora"] == video.model_extra["lora"]
        # a repeat of a completed seeded request is reused; the same one with another adapter scale is not
        again = client.videos.create(prompt="a red ball", size="48x32", seconds="1", extra_body=extra)
        assert again.status == "completed"
        other = client.videos.create(prompt="a red ball", size="48x32", seconds="1",
                                     extra_body={**extra, "lora": [{"name": "style", "scale": 0.75}]})
        assert other.status != "completed" and other.model_extra["lora"] == [{"name": "style", "scale": 0.75}]

        form = httpx.post(s["url"] + "/v1/videos", data={"prompt": "a", "size": "48x32", "seconds": "1", "fps": "1",
                                                         "lora": "musubi:0.75", "sigmas": "[1.0, 0.5]"}, timeout=60)
        assert form.status_code == 200, form.text
        assert form.json()["lora"] == [{"name": "musubi", "scale": 0.75}]
        assert form.json()["options"]["sigmas"] == [1.0, 0.5]
        for lora, message in (([{"name": "nope"}], "unknown LoRA adapter 'nope'"),
                              ([{"name": "style", "scale": "big"}], "scale must be a number"),
                              ({"style": 11}, "scale must be a number")):
            r = httpx.post(s["url"] + "/v1/videos", json={"prompt": "a", "lora": lora}, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "lora" and message in r.json()["error"]["message"]
        r = httpx.post(s["url"] + "/v1/videos", json={"prompt": "a", "sigmas": [1.0] * 300}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sigmas", r.text


def test_the_lora_flag_repeats_and_generate_applies_every_adapter(tmp_path, capfd):
    parser = argparse.ArgumentParser()
    add_cli_args(parser, EngineConfig)
    config = from_cli_args(EngineConfig, parser.parse_args(["--lora", "a=x.safetensors:0.5",
                                                            "--lora", "b=high.safetensors,low.safetensors"]))
    assert config.loras == (LoraAdapter("a", "x.safetensors", 0.5), LoraAdapter("b", "high.safetensors", 1.0,
                                                                                  "low.safetensors"))
    assert from_cli_args(EngineConfig, parser.parse_args([])).loras == ()
    out = tmp_path / "ball.mp4"
    assert main(["generate", "a red ball", "--model", "tiny-wan", "--workers", "1", "--device", "cpu",
                 "--lora", "style=tiny-wan-lora:0.5", "--frames", "1", "--size", "48x32", "--guidance-scale", "1",
                 "--opt", "sigmas=[1.0,0.5]", "-o", str(out)]) == 0
    assert iio.imread(out, extension=".mp4").shape == (1, 32, 48, 3)
    assert "lora style x0.5" in capfd.readouterr().err
    assert main(["generate", "x", "--model", "tiny-wan", "--lora", "style=/no/such.safetensors",
                 "-o", str(tmp_path / "x.mp4")]) == 2
    assert "--lora style=/no/such.safetensors" in capfd.readouterr().err

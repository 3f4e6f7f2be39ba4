"""`profile="fast"` turns on the levers that win on the engine's device, for options left at their defaults only
(each lever stays its own switch); "exact", the default, changes nothing; FP8 is never among them."""

import json

import pytest

from longserve.engine.config import EngineConfig
from longserve.engine.families import detect_family
from longserve.engine.profile import FAST_CACHE, FAST_CFG_TRUNC, fast_levers, resolve_profile
from longserve.weights import resolve_model


def _levers(model, device="cpu", **options):
    config = EngineConfig(model=model, profile="fast", **options)
    path = resolve_model(model)
    family = detect_family(path)
    desc = family.describe(path)
    plan = family.resolve_plan(desc, config.parallel, config.workers, config.ulysses_degree, config.cfg_parallel)
    return fast_levers(config, family, desc, plan, device), config, family, desc


def test_on_cpu_the_fast_profile_is_step_caching_and_cfg_truncation():
    levers, *_ = _levers("tiny-latte")
    assert levers == {"cache": json.dumps(FAST_CACHE), "cfg_trunc_ratio": FAST_CFG_TRUNC}


def test_on_cuda_it_adds_compile_and_a_bf16_vae_and_with_workers_the_rows_split():
    levers, *_ = _levers("tiny-wan", device="cuda", workers=2)
    assert levers["compile"] == "blocks" and levers["vae_dtype"] == "bfloat16" and levers["vae_split"] == "rows"
    assert "quantize" not in levers, "FP8 ran slower (0.69x) where measured: never part of the profile"


def test_an_option_given_explicitly_is_kept_under_the_profile_off_values_included():
    levers, config, family, desc = _levers("tiny-wan", device="cuda", workers=2, compile="none", vae_split="items",
                                           cache="none", cfg_trunc_ratio=0.5)
    assert not {"compile", "vae_split", "cache", "cfg_trunc_ratio"} & set(levers)
    resolved = resolve_profile(config.replace(device="cpu"), family, desc)
    assert (resolved.compile, resolved.vae_split, resolved.cache, resolved.cfg_trunc_ratio) == \
        ("none", "items", None, 0.5)


def test_exact_leaves_every_lever_off_as_before_the_profile_existed():
    config = EngineConfig()
    assert (config.profile, config.compile, config.vae_split, config.cache, config.cfg_trunc_ratio) == \
        ("exact", "none", "items", None, None)


def test_a_family_without_the_request_levers_gets_none_of_them():
    levers, *_ = _levers("tiny-ltx2")
    assert "cache" not in levers and "cfg_trunc_ratio" not in levers


def test_exact_changes_nothing_and_fast_resolves_to_a_config():
    _, config, family, desc = _levers("tiny-latte")
    exact = config.replace(profile="exact")
    assert resolve_profile(exact, family, desc) is exact
    fast = resolve_profile(config, family, desc)
    assert fast.cfg_trunc_ratio == FAST_CFG_TRUNC and json.loads(fast.cache) == FAST_CACHE


def test_a_wrong_profile_is_refused_naming_it():
    with pytest.raises(ValueError, match="profile"):
        EngineConfig(profile="fastest")

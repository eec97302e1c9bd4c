"""remat_policy=autoselected by compiled memory (training/layer_choice.py): the real train step compiled for each
candidate on this CPU, against made-up memory limits; the H100 target (train_compile) is in
tests/compile/test_train_compile_targets.py."""

from __future__ import annotations

import jax
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import load_config, with_overrides
from maxtrain.training import builder, layer_choice

GIB = 2**30


def config(*overrides):
    return load_config(with_overrides(with_overrides([BASE_YML, *TINY], "remat_policy=autoselected"), *overrides))


# activations large against the weights, so that the candidates' compiled memory differs
LONG = ["max_target_length=256", "base_mlp_dim=256"]


def choose(c, capacity):
    devices = jax.devices()[:1]
    return layer_choice.choose(c, lambda plan: builder.build(c, devices=devices, layer_plan=plan), capacity,
                               "a made-up limit")


def test_with_room_nothing_is_recomputed_and_the_layers_are_unrolled():
    roomy = choose(config(), 64 * GIB)
    assert roomy.plan == ("none", False)  # nothing recomputed, layers unrolled
    assert [(t.policy, t.scan, t.fits) for t in roomy.tried] == [("none", True, True), ("none", False, True)]
    summary = builder.summarize(roomy.run, roomy.compiled, 1.0)
    assert "remat: autoselected by compiled memory" in summary and "none unrolled" in summary


@pytest.mark.slow
def test_under_a_tight_limit_the_least_recomputation_that_fits_is_chosen():
    c = config(*LONG)
    # a limit just under what `none` needs with the layers scanned: more recomputation, the first that fits
    need_none = choose(c, 64 * GIB).tried[0].bytes
    tight = choose(c, int(need_none / (1 - layer_choice.HEADROOM)) - 1)
    policies = [t.policy for t in tight.tried]
    assert tight.tried[0].policy == "none" and not tight.tried[0].fits
    chosen = next(t for t in tight.tried if t.fits)
    assert tight.plan[0] == chosen.policy != "none"
    assert all(not t.fits for t in tight.tried[:tight.tried.index(chosen)])
    assert policies == sorted(policies, key=layer_choice.POLICIES.index)
    assert f"-> {tight.plan[0]}" in tight.describe()

    # nothing fits: the least memory (full, scanned) comes back for compile/fit.py to refuse
    hopeless = choose(c, 1024)
    assert hopeless.plan == ("full", True) and not any(t.fits for t in hopeless.tried)


def test_a_scan_layers_the_user_set_is_kept_and_cpu_keeps_its_own_plan():
    assert layer_choice.scan_options(config("scan_layers=true")) == (True,)
    assert layer_choice.scan_options(config()) == (False, True)
    assert layer_choice.scan_options(config("base_num_decoder_layers=40")) == (True,)
    assert not layer_choice.applies(config(), "cpu")  # the CPU default run keeps runtime.resolve_layer_plan's plan
    assert layer_choice.applies(config(), "gpu") and layer_choice.applies(config(), "tpu")
    assert not layer_choice.applies(config("remat_policy=full"), "gpu")

"""scripts/rl_plan.py's logic (maxtrain/training/rl_plan.py): the GRPO update and the rollout's generation compiled for
the halves of a cluster, and the step's phases. The formulas and the halves need no compiler; the compile of a tiny
mixture of experts for 8 H100s needs the [cuda] extra (skipped without it; CI's compiler stage requires it)."""

import math

import jax
import pytest

from conftest import BASE_YML
from maxtrain.compile import targets
from maxtrain.errors import ToolError
from maxtrain.training import builder, losses, rl_plan
from test_train_compile_targets import need

TINY_MOE = [BASE_YML, "decoder_block=qwen3_moe", "base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=4",
            "head_dim=32", "base_mlp_dim=512", "base_num_decoder_layers=2", "vocab_size=1024", "num_experts=8",
            "num_experts_per_tok=2", "base_moe_mlp_dim=128", "dtype=bfloat16", "remat_policy=full", "grpo_beta=0"]


def test_a_cluster_splits_into_two_slices_of_half_its_chips():
    assert rl_plan.half(targets.parse("h100-16")).name == "h100-8"
    tpu = rl_plan.half(targets.parse("v5p-128"))  # 64 chips (MaxText counts v5p TensorCores) -> two of 32
    assert (tpu.name, tpu.num_chips, tpu.shape) == ("v5p-64", 32, (2, 4, 4))
    with pytest.raises(ToolError, match="splits one slice"):
        rl_plan.half(targets.parse("v5p-128", 2))


def test_phases_follow_the_stated_formulas():
    shape = rl_plan.Shape(prompts=64, generations=16, rows=256)   # 1024 completions: 4 waves on one sampler
    p = rl_plan.phases(shape, update_half=30.0, update_all=16.0, wave=10.0, sync_seconds=0.5)
    assert (p["generation_half"], p["generation_all"]) == (40.0, 20.0)  # two replicas colocated: half the waves
    assert p["colocated"] == 20.0 + 16.0 and p["off_policy"] == 40.0 + 0.5
    assert p["speedup"] == pytest.approx(36.0 / 40.5)


def test_generation_is_taken_as_predicted_and_as_the_roofline_of_the_filled_cache():
    shape = rl_plan.Shape(prompts=4, generations=4, rows=16)   # one wave
    sampler = {"seconds": 9.0, "roofline": {"prefill": 1.0, "decode_filled_cache": 2.0, "decode_static_cache": 4.0}}
    both = rl_plan.both_phases(shape, {"seconds": 5.0}, {"seconds": 3.0}, sampler, 0.0)
    assert both["predicted"]["generation_half"] == 9.0 and both["roofline"]["generation_half"] == 3.0


def test_the_sampler_keeps_its_weights_whole_along_embed():
    rules = rl_plan.sampler_rules([["batch", ["data", "fsdp"]], ["embed", ["fsdp", "expert"]], ["exp", "expert"]])
    assert rules == (("batch", ["data", "fsdp"]), ("exp", "expert"))


def test_update_and_generation_compile_for_8_h100s_with_the_decode_loop_counted():
    """The trainer's program is objective=grpo's step (pi_old and advantages in its batch); the sampler's holds the
    experts split over the expert axis and the rest whole, and its prediction counts the decode loop's every step:
    four times the completion tokens predict about four times the decode's work."""
    need("gpu")
    target = targets.parse("h100-8")
    shape = rl_plan.Shape(prompts=4, generations=4, prompt=64, completion=64, rows=16)
    config = rl_plan.load(TINY_MOE, shape, target, [], 1)
    trainer = rl_plan.compile_trainer(config, target)
    assert trainer["fits"] and trainer["seconds"] > 0 and trainer["mesh"]["fsdp"] == 8
    assert config.objective == "grpo" and config.gradient_accumulation_steps * 8 == shape.completions
    assert {"old_log_probs", "advantages"} <= set(losses.batch_keys(config))  # the GRPO update's batch

    sampler_config = rl_plan.load(TINY_MOE, shape, target, ["ici_expert_parallelism=8"], 1)
    run = builder.build(sampler_config, devices=target.devices(), platform="gpu", num_processes=1)
    params = jax.tree.leaves(rl_plan.sampler_program(run, shape)[1][0])
    experts = [x for x in params if "expert" in str(x.sharding.spec)]
    whole = [x for x in params if all(a is None for a in x.sharding.spec)]
    assert experts and whole and len(experts) + len(whole) == len(params)
    assert all(x.dtype.name == "bfloat16" for x in params)

    short = rl_plan.compile_sampler(sampler_config, target, shape)
    long = rl_plan.compile_sampler(sampler_config, target, rl_plan.Shape(4, 4, 64, 256, 16))
    assert short["fits"] and short["unknown_trip_counts"] == 0 and short["mesh"]["expert"] == 8
    ratio = long["prediction"]["compute_seconds"] / short["prediction"]["compute_seconds"]
    assert 2.5 < ratio < 6, ratio  # one count of the loop would leave it near 1
    assert math.isclose(long["roofline"]["kv_bytes_per_token"], 2 * 2 * 4 * 32 * 2)  # k and v, 2 layers, 4 heads


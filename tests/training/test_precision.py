"""Mixed precision: float16 dynamic loss scaling, bfloat16/float16 training end to end.

Overflows are real: a loss scale of 2**100 makes the float16 backward pass overflow to inf (as a
too-large scale does in practice), and a loss weight of inf in the batch puts inf into every
gradient. Nothing is mocked: the compiled train step decides to skip.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.training import builder, precision
from maxtrain import train
from maxtrain.config import load_config, with_overrides


def assert_trees_bitwise_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def with_scale(state, scale):
    return {**state, "loss_scale": {**state["loss_scale"], "scale": jnp.asarray(scale, jnp.float32)}}


@pytest.fixture(scope="module")
def float16_step():
    run = builder.build(load_config([BASE_YML, *with_overrides(TINY, "dtype=float16", "loss_scale_period=2",
                                     "loss_scale_min=1.0", "learning_rate=1e-2", "warmup_steps_fraction=0")]),
                        devices=jax.devices()[:1])
    cfg, state = run.config, run.init(jax.random.key(0))
    return cfg, state, jax.jit(run.train_step.__wrapped__), random_batch(cfg, 2)  # not donating: the tests reuse states


def random_batch(cfg, rows: int) -> dict:
    """One micro-batch of `rows` random sequences, every token real."""
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, rows, cfg.max_target_length + 1)).astype(np.int32)
    shape = (1, rows, cfg.max_target_length)
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(shape[-1], dtype=np.int32), shape).copy(),
            "loss_weights": np.ones(shape, np.float32)}


def test_update_loss_scale_rules():
    cfg = load_config([BASE_YML, "dtype=float16", "loss_scale_period=3", "loss_scale_min=4.0"])
    s = {"scale": jnp.float32(16.0), "good_steps": jnp.int32(0), "skipped_steps": jnp.int32(0)}
    s = precision.update_loss_scale(s, jnp.bool_(False), cfg)
    assert (float(s["scale"]), int(s["good_steps"]), int(s["skipped_steps"])) == (8.0, 0, 1)
    s = precision.update_loss_scale(precision.update_loss_scale(s, jnp.bool_(False), cfg), jnp.bool_(False), cfg)
    assert (float(s["scale"]), int(s["skipped_steps"])) == (4.0, 3)  # 8 -> 4 -> floor at 4
    for expected_good in (1, 2):
        s = precision.update_loss_scale(s, jnp.bool_(True), cfg)
        assert (float(s["scale"]), int(s["good_steps"])) == (4.0, expected_good)
    s = precision.update_loss_scale(s, jnp.bool_(True), cfg)  # third finite step in a row: grow
    assert (float(s["scale"]), int(s["good_steps"]), int(s["skipped_steps"])) == (8.0, 0, 3)
    s = precision.update_loss_scale(s, jnp.bool_(False), cfg)  # an overflow also resets the streak
    assert (float(s["scale"]), int(s["good_steps"])) == (4.0, 0)


def test_float16_overflow_skips_the_update_and_halves_the_scale(float16_step):
    cfg, state, step, batch = float16_step
    new, metrics = step(with_scale(state, 2.0**100), batch)  # float16 backward overflows
    assert not np.isfinite(float(metrics["grad_norm"])) and np.isfinite(float(metrics["loss"]))
    assert_trees_bitwise_equal(new["params"], state["params"])
    assert_trees_bitwise_equal(new["opt_state"], state["opt_state"])
    assert float(new["loss_scale"]["scale"]) == 2.0**99
    assert int(new["loss_scale"]["skipped_steps"]) == 1 and int(new["loss_scale"]["good_steps"]) == 0
    assert int(new["step"]) == 1 and float(metrics["skipped_steps"]) == 1


def test_inf_in_the_batch_skips_after_real_updates_and_the_scale_has_a_floor(float16_step):
    cfg, state, step, batch = float16_step
    state = with_scale(state, 4.0)
    after_one, m1 = step(state, batch)
    after_two, m2 = step(after_one, batch)
    # Finite steps update, and after loss_scale_period=2 of them in a row the scale doubles.
    assert int(m1["skipped_steps"]) == 0 and int(after_one["loss_scale"]["good_steps"]) == 1
    assert float(after_one["loss_scale"]["scale"]) == 4.0
    assert float(after_two["loss_scale"]["scale"]) == 8.0 and int(after_two["loss_scale"]["good_steps"]) == 0
    assert not np.array_equal(after_two["params"]["layers"]["decoder"]["wq"], state["params"]["layers"]["decoder"]["wq"])

    poisoned = {**batch, "loss_weights": batch["loss_weights"].copy()}
    poisoned["loss_weights"][0, 0, 3] = np.inf  # every gradient becomes inf or nan
    skipped, m3 = step(after_two, poisoned)
    assert_trees_bitwise_equal(skipped["params"], after_two["params"])
    assert_trees_bitwise_equal(skipped["opt_state"], after_two["opt_state"])
    assert float(skipped["loss_scale"]["scale"]) == 4.0 and int(skipped["loss_scale"]["skipped_steps"]) == 1
    # The schedule advances with applied updates only (the optimizer's count was not touched),
    # so the step after the skip uses, and logs, the rate the skipped step would have used.
    _, m4 = step(skipped, batch)
    assert float(m4["learning_rate"]) == float(m3["learning_rate"]) != float(m2["learning_rate"])

    at_floor, _ = step(with_scale(after_two, cfg.loss_scale_min), poisoned)
    assert float(at_floor["loss_scale"]["scale"]) == cfg.loss_scale_min  # never below loss_scale_min
    assert_trees_bitwise_equal(at_floor["params"], after_two["params"])


def test_float32_and_bfloat16_carry_a_fixed_unit_scale():
    for dtype in ("float32", "bfloat16"):
        cfg = load_config([BASE_YML, *with_overrides(TINY, f"dtype={dtype}")])
        state = precision.init_loss_scale(cfg, jnp.dtype(dtype))
        assert float(state["scale"]) == 1.0 and not precision.uses_loss_scaling(jnp.dtype(dtype))


def read_metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines() if "learning/loss" in line]


@pytest.mark.slow
def test_loss_scale_is_logged_checkpointed_and_resumed(tiny_args, tmp_path, capsys):
    metrics_file = tmp_path / "m.jsonl"
    args = with_overrides(tiny_args, "dataset_type=synthetic", "dtype=float16", f"loss_scale_initial={2.0**100}",
                          "log_period=1", "checkpoint_period=2", "async_checkpointing=false", f"metrics_file={metrics_file}")
    first = train.main([*args, "steps=2"])  # a real float16 run: both steps overflow and are skipped
    out = capsys.readouterr().out
    assert "dtype float16" in out and "memory per device:" in out
    assert "attention dot_product (autoselected for cpu)" in out
    assert f"loss_scale {2.0**99:g} skipped 1" in out and f"loss_scale {2.0**98:g} skipped 2" in out
    assert int(first.state["loss_scale"]["skipped_steps"]) == 2

    second = train.main([*args, "steps=3"])  # resumes from the step-2 checkpoint
    assert "Resuming from" in capsys.readouterr().out
    rows = read_metrics(metrics_file)
    assert [r["learning/loss_scale"] for r in rows] == [2.0**99, 2.0**98, 2.0**97]
    assert [r["learning/skipped_steps"] for r in rows] == [1, 2, 3]
    assert float(second.state["loss_scale"]["scale"]) == 2.0**97


def run_steps(state, step, batch, vocab_size, num_steps):
    """num_steps train steps on fresh random tokens each step; returns (state, losses)."""
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(num_steps):
        tokens = rng.integers(0, vocab_size, batch["inputs"].shape[:-1] + (batch["inputs"].shape[-1] + 1,))
        state, metrics = step(state, {**batch, "inputs": tokens[..., :-1].astype(np.int32),
                                      "targets": tokens[..., 1:].astype(np.int32)})
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_training_has_no_nan(dtype, float16_step):
    cfg, state, step, batch = float16_step  # float16 starts from the default loss_scale_initial (32768)
    assert float(state["loss_scale"]["scale"]) == 32768.0
    if dtype == "bfloat16":
        run = builder.build(cfg.replace(dtype=dtype), devices=jax.devices()[:1])
        state, step = run.init(jax.random.key(0)), run.train_step
    state, losses = run_steps(state, step, batch, cfg.vocab_size, 5)
    assert all(np.isfinite(losses)), losses
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(state["params"]))
    skipped = int(state["loss_scale"]["skipped_steps"])
    if dtype == "float16":
        assert skipped < 5  # updates were applied, not all skipped
    else:
        assert skipped == 0 and float(state["loss_scale"]["scale"]) == 1.0


def test_bfloat16_weights_keep_their_state_types_step_after_step():
    """weight_dtype=bfloat16: the optimizer's moments are created bfloat16 and stay so (computed from float32
    gradients they came back float32, and the compiled step then refused its own output at step 2)."""
    run = builder.build(load_config([BASE_YML, *with_overrides(TINY, "weight_dtype=bfloat16")]),
                        devices=jax.devices()[:1])
    cfg, state = run.config, run.init(jax.random.key(0))
    batch, step = random_batch(cfg, 1), jax.jit(run.train_step.__wrapped__)
    types = jax.tree.map(lambda a: a.dtype, state)
    for _ in range(2):
        state, metrics = step(state, batch)
        assert jax.tree.map(lambda a: a.dtype, state) == types
    assert np.isfinite(float(metrics["loss"]))

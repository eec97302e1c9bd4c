"""GRPO's loss types (training/policy_losses.py) on hand-computed numbers: each normalisation's (loss sum, weight),
GSPO's sequence-level weight, CISPO's stop-gradient weight and the KL's bias correction; the settings against base.yml
and the rollout. (tests/training/test_grpo_trl.py checks every variant against TRL through the train step.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain.config import schema
from maxtrain.training import grpo, policy_losses
from post_helpers import compose


def _config(tmp_path, loss_type="dapo", level="token"):
    return config_lib.load_config(compose(BASE_YML, *TINY, "objective=grpo", "train_data_columns=[prompt,answer]",
                                          "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                          "decode_sampling_strategy=weighted", "max_prefill_predict_length=8",
                                          f"grpo_loss_type={loss_type}", f"grpo_importance_sampling_level={level}",
                                          "grpo_epsilon_high=5" if loss_type == "cispo" else "grpo_beta=0.04",
                                          f"base_output_directory={tmp_path}"))


LOSS = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]], np.float32)   # 9: padding (weight 0)
WEIGHTS = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)


@pytest.mark.parametrize("loss_type, want", [
    ("dapo", (15.0, 5.0)),                 # the step's token mean: sum / tokens
    ("cispo", (15.0, 5.0)),
    ("grpo", (2.0 + 4.5, 2.0)),            # each completion's token mean, summed; weight: completions
    ("bnpo", (3.0, 1.0)),                  # the micro-batch's token mean; weight 1
    ("dr_grpo", (15.0, 2.0 * 24)),         # sum; weight: completions x max completion length
])
def test_each_normalisation_is_a_loss_sum_and_a_weight(loss_type, want):
    s = {"loss_type": loss_type, "max_completion_length": 24}
    total, weight = policy_losses.normalised(jnp.asarray(LOSS), jnp.asarray(WEIGHTS), jnp.float32(2.0), s)
    np.testing.assert_allclose([float(total), float(weight)], want, rtol=1e-6)


def test_the_sequence_level_weight_cispo_and_the_bias_corrected_kl_by_hand():
    lp = jnp.array([[-1.0, -2.0, -3.0]])
    old = jnp.array([[-1.2, -1.9, 0.0]])
    ref = jnp.array([[-1.1, -2.5, -3.0]])
    w = jnp.array([[1.0, 1.0, 0.0]])
    a = jnp.full((1, 3), 2.0)
    log_w = policy_losses.log_importance_weights(lp - old, w, "sequence")
    np.testing.assert_allclose(np.asarray(log_w), [[(0.2 - 0.1) / 2]], rtol=1e-6)  # the mean over weighted tokens
    # cispo: -sg(min(w, cap)) A log pi; its gradient in log pi is -min(w, cap) A
    grad = jax.grad(lambda x: jnp.sum(policy_losses.cispo_token_loss(x, old, None, a, 0.0, 1.1)[0] * w))(lp)
    ratio = np.exp(np.asarray(lp - old))
    np.testing.assert_allclose(np.asarray(grad)[0, :2], -np.minimum(ratio[0, :2], 1.1) * 2.0, rtol=1e-6)
    # the bias-corrected KL: k3 x w, with w's gradient
    loss, k3, _ = policy_losses.grpo_token_loss(lp, old, ref, a, 0.5, 0.2, kl_bias_correction=True)
    d = np.asarray(ref - lp)
    np.testing.assert_allclose(np.asarray(k3), (np.exp(d) - d - 1) * ratio, rtol=1e-4)  # k3 cancels in float32


def test_the_settings_name_what_trl_and_the_rollout_do(tmp_path):
    """base.yml's grpo_loss_type choices are policy_losses'; dr_grpo's constant is the sampler's completion budget;
    grpo_epsilon_high -1 is grpo_epsilon (TRL's None); the sequence level's notice."""
    allowed = schema.table()["grpo_loss_type"].allowed
    assert all(allowed.admits(kind) for kind in policy_losses.LOSS_TYPES) and not allowed.admits("ppo")
    levels = schema.table()["grpo_importance_sampling_level"].allowed
    assert all(levels.admits(level) for level in policy_losses.LEVELS) and not levels.admits("batch")
    config = _config(tmp_path)
    s = policy_losses.settings(config)
    assert s["max_completion_length"] == grpo.completion_length(config) == 24
    assert s["epsilon_high"] == config.grpo_epsilon
    # the sequence-level weight under a loss that sums token losses: one line of notice (TRL warns), not refused
    assert policy_losses.sequence_level_note(config) == ""
    summed = _config(tmp_path, "dr_grpo", "sequence")
    assert "grpo_loss_type=dr_grpo sums token losses" in policy_losses.sequence_level_note(summed)
    assert policy_losses.sequence_level_note(_config(tmp_path, "grpo", "sequence")) == ""

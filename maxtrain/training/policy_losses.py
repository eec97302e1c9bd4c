"""GRPO's policy losses (grpo_loss_type), each as TRL 1.16's GRPOTrainer computes it, in the train step's contract.

    s = policy_losses.settings(config)
    loss, parts = policy_losses.token_loss(log_probs, old_log_probs, ref_log_probs, advantages, weights, s)
    loss_sum, weight = policy_losses.normalised(loss, weights, rows, s)   # what losses.grpo returns
    metrics = policy_losses.metrics(parts, weights, rows, s)

Per completion token, with A the row's advantage, w = exp(log pi - log pi_old) its importance ratio: per token
(grpo_importance_sampling_level=token), or GSPO's per row (=sequence: exp of the mean over the completion's tokens
of log pi - log pi_old, Zheng et al. 2025), and eps_low = grpo_epsilon, eps_high = grpo_epsilon_high:

    grpo, bnpo, dr_grpo, dapo   -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)   (clip-higher: DAPO, Yu et al. 2025)
    cispo                       -sg(min(w, eps_high)) A log pi    (MiniMax-M1 2025: the clipped weight, no gradient)

plus beta k3, k3 = ref / pi - log(ref / pi) - 1 (beta = grpo_beta), times w with grpo_kl_bias_correction (TRL's
use_bias_correction_kl, DeepSeek-V3.2: the unbiased reverse-KL gradient off-policy).

The train step sums every micro-batch's (loss sum, weight) and divides (training/train_step.py); each loss type's
normalisation is one such pair per micro-batch of b rows (TRL divides each micro-batch's loss by the accumulation
steps; with equal micro-batches both give the same step loss and gradients):

    dapo, cispo   (sum of token losses, tokens): the mean over all completion tokens of the step (DAPO's)
    grpo          (sum over rows of the row's token mean, rows): the mean over completions of their token means
    bnpo          (the micro-batch's token mean, 1): the mean over micro-batches of their token means
    dr_grpo       (sum of token losses, rows x max completion length): Dr. GRPO's constant (Liu et al. 2025)

A row is one completion (its prompt before it, padding after); rows are the step's real rows (any segment id).
Metrics as TRL logs them: grpo_clip_fraction (TRL's clip_ratio/region_mean), grpo_clip_ratio_low and _high (clipped
below with A < 0, above with A > 0), cispo's grpo_cispo_clip_ratio (w above the cap with A > 0), grpo_kl (the KL
term as added, after the bias correction), grpo_log_ratio; per token, or per row at the sequence level.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")    # base.yml's grpo_loss_type choices (a test checks)
LEVELS = ("token", "sequence")                               # grpo_importance_sampling_level's (a test checks)
TOKEN_SUMS = ("bnpo", "dr_grpo", "dapo", "cispo")            # sum token losses: TRL warns of them at the sequence level


def max_completion_length(config) -> int:
    """dr_grpo's constant: the tokens a completion may have (grpo.completion_length, the sampler's budget; a test
    checks that both say the same)."""
    return config.max_target_length - config.max_prefill_predict_length


def settings(config) -> dict:
    """The loss's settings from a config: grpo_epsilon_high -1 is grpo_epsilon (TRL's None)."""
    high = config.grpo_epsilon_high
    return {"loss_type": config.grpo_loss_type, "beta": config.grpo_beta, "epsilon": config.grpo_epsilon,
            "epsilon_high": config.grpo_epsilon if high < 0 else high,
            "level": config.grpo_importance_sampling_level, "kl_bias_correction": config.grpo_kl_bias_correction,
            "max_completion_length": max_completion_length(config)}


def sequence_level_note(config) -> str:
    """One line of notice for the sequence-level ratio under a loss that sums token losses ("" otherwise): TRL warns
    of it too. It trains (each completion weighted by its length), so it is said, not refused."""
    if config.grpo_importance_sampling_level != "sequence" or config.grpo_loss_type not in TOKEN_SUMS:
        return ""
    return (f"note: grpo_importance_sampling_level=sequence with grpo_loss_type={config.grpo_loss_type} sums token "
            "losses, so each completion weighs by its length rather than the per-sequence objective; GSPO's paper "
            "uses grpo_loss_type=grpo")


def log_importance_weights(log_ratio, weights, level: str):
    """log w: per token [B, T], or per row [B, 1] (the mean of log_ratio over the row's weighted tokens)."""
    if level == "token":
        return log_ratio
    return (jnp.sum(log_ratio * weights, axis=-1, keepdims=True)
            / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1.0))


def grpo_token_loss(log_probs, old_log_probs, ref_log_probs, advantages, beta: float, epsilon: float,
                    epsilon_high: float | None = None, log_weights=None, kl_bias_correction: bool = False, tis=None):
    """The clipped per-token loss [..., T] and its parts (clipped: the clipped branch is the minimum; k3: the KL term
    as added; ratio: w); ref_log_probs is None when beta is 0. log_weights: log w where it is not the token's log
    ratio (GSPO's per-row weight); epsilon_high None is epsilon."""
    ratio = jnp.exp(log_probs - old_log_probs if log_weights is None else log_weights)
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + high) * advantages
    loss = -jnp.minimum(unclipped, clipped)
    if tis is not None:
        loss = loss * tis
    return _with_kl(loss, log_probs, ref_log_probs, ratio, beta, kl_bias_correction) + (
        {"clipped": clipped < unclipped, "ratio": ratio},)


def cispo_token_loss(log_probs, old_log_probs, ref_log_probs, advantages, beta: float, cap: float, log_weights=None,
                     kl_bias_correction: bool = False, tis=None):
    """CISPO's per-token loss -sg(min(w, cap)) A log pi (+ beta k3) and its parts."""
    ratio = jnp.exp(log_probs - old_log_probs if log_weights is None else log_weights)
    loss = -jax.lax.stop_gradient(jnp.minimum(ratio, cap)) * advantages * log_probs
    if tis is not None:
        loss = loss * tis
    return _with_kl(loss, log_probs, ref_log_probs, ratio, beta, kl_bias_correction) + ({"ratio": ratio},)


def _with_kl(loss, log_probs, ref_log_probs, ratio, beta: float, kl_bias_correction: bool):
    """(loss + beta k3, k3 as added): k3 times w with the bias correction."""
    k3 = jnp.zeros_like(loss)
    if ref_log_probs is not None:
        log_ratio = ref_log_probs - log_probs
        k3 = jnp.exp(log_ratio) - log_ratio - 1.0
        if kl_bias_correction:
            k3 = k3 * ratio
        loss = loss + beta * k3
    return loss, k3


def token_loss(log_probs, old_log_probs, ref_log_probs, advantages, weights, s: dict, tis=None):
    """(per-token loss [B, T], parts) of the loss type `s["loss_type"]` (settings' dict); tis: the truncated
    importance weights of rollout workers' tokens (None: none, the colocated program)."""
    log_w = None if s["level"] == "token" else log_importance_weights(log_probs - old_log_probs, weights, s["level"])
    if s["loss_type"] == "cispo":
        loss, k3, parts = cispo_token_loss(log_probs, old_log_probs, ref_log_probs, advantages, s["beta"],
                                           s["epsilon_high"], log_w, s["kl_bias_correction"], tis)
    else:
        loss, k3, parts = grpo_token_loss(log_probs, old_log_probs, ref_log_probs, advantages, s["beta"],
                                          s["epsilon"], s["epsilon_high"], log_w, s["kl_bias_correction"], tis)
    return loss, {**parts, "k3": k3}


def real_rows(segment_ids):
    """The rows that hold a sequence (float32 scalar): padding rows have no segment."""
    return jnp.sum(jnp.any(segment_ids > 0, axis=-1).astype(jnp.float32))


def normalised(loss, weights, rows, s: dict):
    """(loss sum, weight) of one micro-batch for the train step to sum and divide (the module's table)."""
    kind = s["loss_type"]
    if kind in ("dapo", "cispo"):
        return jnp.sum(loss * weights), jnp.sum(weights)
    if kind == "grpo":
        per_row = jnp.sum(loss * weights, axis=-1) / jnp.maximum(jnp.sum(weights, axis=-1), 1.0)
        return jnp.sum(per_row), rows
    if kind == "bnpo":
        return jnp.sum(loss * weights) / jnp.maximum(jnp.sum(weights), 1.0), jnp.ones((), jnp.float32)
    if kind == "dr_grpo":
        return jnp.sum(loss * weights), rows * float(s["max_completion_length"])
    raise ValueError(f"unknown grpo_loss_type {kind!r}")  # config/objectives.py refuses it before this


def metrics(parts: dict, advantages, weights, rows, s: dict) -> dict:
    """The loss's metrics as TRL logs them (module docstring): means over tokens, at the sequence level over rows."""
    tokens = jnp.sum(weights)

    def mean(x):  # over the weighted tokens
        return jnp.sum(jnp.where(weights > 0, x, 0.0) * weights) / jnp.maximum(tokens, 1.0)

    def fraction(flag):  # a flag per token, or per row at the sequence level (A is the row's on every token)
        flag = flag.astype(jnp.float32)
        if s["level"] == "token":
            return mean(flag)
        per_row = jnp.sum(flag * weights, axis=-1) / jnp.maximum(jnp.sum(weights, axis=-1), 1.0)
        return jnp.sum(per_row) / jnp.maximum(rows, 1.0)

    ratio = parts["ratio"]
    out = {"grpo_kl": mean(parts["k3"])}
    if s["loss_type"] == "cispo":
        out["grpo_cispo_clip_ratio"] = fraction((ratio > s["epsilon_high"]) & (advantages > 0))
        return out
    if s["level"] == "token":
        out["grpo_clip_fraction"] = mean(parts["clipped"].astype(jnp.float32))
    else:
        out["grpo_clip_fraction"] = fraction(parts["clipped"])
    out["grpo_clip_ratio_low"] = fraction((ratio < 1.0 - s["epsilon"]) & (advantages < 0))
    out["grpo_clip_ratio_high"] = fraction((ratio > 1.0 + s["epsilon_high"]) & (advantages > 0))
    return out

"""Truncated importance sampling (TIS) for completions an engine sampled: per completion token the weight
min(exp(log pi_old - log p_engine), grpo_tis_cap), pi_old the trainer's own log-probability of the token (TRL's
vllm_importance_sampling_correction, token_truncate: the weight multiplies the token's policy loss, not the KL term),
and the mismatch metrics logged every step."""

from __future__ import annotations

import numpy as np


def tis_weights(trainer: np.ndarray, engine: np.ndarray, mask: np.ndarray, cap: float) -> tuple[np.ndarray, dict]:
    """(weights [..., T] float32, 0 off the completion tokens; metrics) for log-probabilities [..., T] of the trainer
    and the engine on the tokens where mask > 0."""
    on = mask > 0
    diff = np.where(on, trainer.astype(np.float64) - engine.astype(np.float64), 0.0)
    raw = np.where(on, np.exp(diff), 0.0)
    weights = np.where(on, np.minimum(raw, cap), 0.0).astype(np.float32)
    return weights, {**mismatch(trainer, engine, mask),
                     "aux/grpo_tis_weight_mean": float(weights[on].mean()) if on.any() else 1.0,
                     "aux/grpo_tis_weight_max": float(weights[on].max()) if on.any() else 1.0,
                     "aux/grpo_tis_capped_fraction": float((raw[on] > cap).mean()) if on.any() else 0.0}


def mismatch(trainer: np.ndarray, engine: np.ndarray, mask: np.ndarray) -> dict:
    """Mean and max |log p_trainer - log p_engine| over the completion tokens."""
    on = mask > 0
    gap = np.abs(trainer.astype(np.float64) - engine.astype(np.float64))[on]
    return {"aux/grpo_logp_mismatch_mean": float(gap.mean()) if gap.size else 0.0,
            "aux/grpo_logp_mismatch_max": float(gap.max()) if gap.size else 0.0}

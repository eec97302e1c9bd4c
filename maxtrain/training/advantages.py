"""GRPO's rewards -> advantages, and the reward shaping before them: pure numpy functions of a rollout's rewards.

    shaped = rewards + advantages.overlong_penalty(lengths, max_length, buffer, factor)   # DAPO, Eq. 13
    adv = advantages.advantages(shaped, group, estimator="grpo", scale="group", ddof=0)
    varied = advantages.varied_groups(shaped, group)                                  # DAPO's dynamic sampling

Rewards [N] come in consecutive groups of G = num_generations completions of one prompt. An advantage is a
completion's reward minus its group's baseline, scaled:

    estimator grpo   baseline = the group's mean                      (Shao et al. 2024; TRL's GRPOTrainer)
              rloo   baseline = the mean of the other G - 1 rewards   (Ahmadian et al. 2024; TRL's RLOOTrainer:
                     A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) (r_i - mean))
    scale     group  A / (std of its group + 1e-4)                    (TRL's scale_rewards="group", its default)
              batch  A / (std of all N rewards + 1e-4)                (TRL's "batch": Hu et al.'s REINFORCE++)
              none   A unscaled                                        (Dr. GRPO, Liu et al. 2025; TRL's "none";
                                                                        TRL's RLOOTrainer with its default
                                                                        normalize_advantages=False)
    ddof      0      the population std, sqrt(sum (r - mean)^2 / n)     (maxtrain's default: its behaviour since
                                                                        GRPO came in; DeepSeekMath's formula
                                                                        does not say which)
              1      the sample std, sqrt(sum (r - mean)^2 / (n - 1))   (torch.std's, so TRL's and Tunix's)

At G = 4 the sample std is sqrt(4 / 3) = 1.155x the population std, so TRL's advantages are 1 / 1.155 of
maxtrain's default ones (the step is that much smaller at the same learning rate); ddof=1 gives TRL's exactly.

The arithmetic is float64 on the host, the result float32 (the update batch's dtype).
"""

from __future__ import annotations

import numpy as np

ADVANTAGE_EPS = 1e-4  # TRL's: the std's floor, so a group whose rewards are all equal has A = 0
ESTIMATORS = ("grpo", "rloo")
SCALES = ("group", "batch", "none")


def advantages(rewards: np.ndarray, group: int, estimator: str = "grpo", scale: str = "group",
               ddof: int = 0) -> np.ndarray:
    """Advantages [N] float32 of rewards [N] in consecutive groups of `group` (see the module's docstring)."""
    r = rewards.reshape(-1, group).astype(np.float64)
    if estimator == "grpo":
        centred = r - r.mean(axis=1, keepdims=True)
    elif estimator == "rloo":
        centred = r - (r.sum(axis=1, keepdims=True) - r) / (group - 1)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if scale == "group":
        a = centred / (r.std(axis=1, keepdims=True, ddof=ddof) + ADVANTAGE_EPS)
    elif scale == "batch":
        a = centred / (r.std(ddof=ddof) + ADVANTAGE_EPS)
    elif scale == "none":
        a = centred
    else:
        raise ValueError(f"unknown reward scaling {scale!r}")
    return a.reshape(-1).astype(np.float32)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13) [N] float64, <= 0, for completion lengths [N] (in
    tokens, the stop token included, as TRL counts them): 0 up to max_length - buffer tokens, then falling linearly to
    -factor at max_length, -factor beyond. factor=1 is trl.rewards.get_soft_overlong_punishment(max_length, buffer);
    factor is verl's overlong_penalty_factor. buffer=0 is no shaping."""
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths)
    start = max_length - buffer
    return factor * np.where(lengths <= start, 0.0, np.maximum((start - lengths) / buffer, -1.0))


def varied_groups(rewards: np.ndarray, group: int) -> np.ndarray:
    """Whether each group's rewards differ [N / group] bool: DAPO's dynamic sampling keeps those (a group whose
    rewards are all equal has A = 0 under every estimator and scaling here, so it teaches nothing)."""
    r = rewards.reshape(-1, group)
    return (r != r[:, :1]).any(axis=1)

"""What training minimizes: lm, sft, dpo, distill and grpo, each a pure function of (params, batch, reference).

    objective = losses.make(config, model, rt)
    loss_sum, weight_sum, metrics = objective(params, batch, reference)

The objective's losses, named apart from config/objectives.py (the rows). Which one runs is the `objective`
key (config/objectives.py: its row declares the data it reads, the
frozen model the state holds and the extra batch entries; `LOSSES` below is each row's loss). The train
step divides the summed loss of all its micro-batches by their summed weight and adds every metric named
`*_loss` (already a mean, times the weight: models/decoder.objective); it never asks which objective it runs.
Metrics are means over the micro-batch's weight, reported as `learning/<name>` (training) and
`eval/<name>` (evaluation).

    lm    next-token cross-entropy: sum over targets of loss_weight x (-log p(target)); the weight
          is the number of weighted targets. Pre-training data weights every real token.
    sft   the same function. The weights come from the chat template (data/chat.py): with
          sft_train_on_completion_only only the assistant's tokens count.
    dpo   direct preference optimization (Rafailov et al. 2023) on pairs of completions of one
          prompt. A batch row holds pairs as consecutive segments 2k-1 (prompt + chosen) and 2k
          (prompt + rejected); loss_weights are +1 on the chosen completion's targets, -1 on the
          rejected one's and 0 elsewhere (data/chat.py). With log-ratios against the frozen
          reference model,
              r_c = beta (log pi(chosen) - log ref(chosen))      r_r = the same for rejected
              loss = -(1 - eps) log sigmoid(r_c - r_r) - eps log sigmoid(r_r - r_c)
          summed over pairs (eps = dpo_label_smoothing); the weight is the number of pairs.
    distill  knowledge distillation: `reference` is the frozen teacher (training/distillation.py),
          per weighted target alpha T^2 KL(teacher || student at temperature T) + (1 - alpha) x
          cross-entropy (models/distill.py); the weight is the number of weighted targets. Both parts
          are reported, as means per target: distill_kl and distill_ce (the student's next-token loss,
          comparable with an lm run's loss).
    distill_on_policy  on-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): rows are prompt
          + a completion the student sampled (training/on_policy.py), loss_weights 1 on the completion's tokens;
          per weighted target KL(student || teacher) over the whole vocabulary, both at the sampler's
          temperature (models/distill.reverse_terms); the weight is the number of completion tokens, so the
          batch's loss is the mean over them, as TRL's DistillationTrainer (beta=1) reduces it.
    grpo  group relative policy optimization (Shao et al. 2024, DeepSeek-R1) on completions the
          policy sampled (training/grpo.py). A row is prompt + one completion; loss_weights are 1 on
          the completion's tokens (through its stop token) and 0 on the prompt and padding;
          `advantages` holds the row's group-normalized reward A on every token, `old_log_probs`
          the sampler's log pi_old(token); pi, pi_old and ref are softmax(logits / T) at the
          sampling temperature T. Per completion token, with r = pi / pi_old,
              loss = -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta k3,
              k3 = ref / pi - log(ref / pi) - 1      (Schulman's unbiased estimator of KL(pi || ref))
          (eps = grpo_epsilon, beta = grpo_beta), summed over completion tokens; the weight is their
          number, so the batch's loss is the mean over all its completion tokens (grpo_loss_type=dapo,
          the default: DAPO's and TRL's normalization, a long completion counts per token). The other
          loss types (grpo, bnpo, dr_grpo, cispo), clip-higher, GSPO's sequence-level ratio and the KL's
          bias correction are training/policy_losses.py's, each a (loss sum, weight) as TRL normalises it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain import config as config_lib

from maxtrain.models.model import Model
from maxtrain.models import distill as distill_lib
from maxtrain.models.runtime import Runtime
from maxtrain.models import sampling
from maxtrain.training import distillation, policy_losses

def name(config) -> str:
    return config.objective


def needs_reference(config) -> bool:
    """Whether the state holds a frozen reference model (the starting params): DPO's, GRPO's KL term's."""
    return config_lib.objectives.of(config).frozen == "reference" and config_lib.objectives.holds_frozen(config)


def batch_keys(config) -> tuple[str, ...]:
    """The float32 batch entries the objective reads beyond data/hosts.KEYS (its row's batch_keys; GRPO's
    tis_weights when its rollout workers' tokens are corrected: config/objectives.grpo_corrects)."""
    keys = config_lib.objectives.of(config).batch_keys
    return keys + ("tis_weights",) if config_lib.objectives.grpo_corrects(config) else keys


def make(config, model: Model, rt: Runtime):
    """The run's objective for `model` (the run's bound model; config: its settings, model.config with the
    devices' values): fn(params, batch, reference) -> (loss sum, weight sum, metrics)."""
    kind = name(config)
    loss = LOSSES[kind]
    if config_lib.objectives.of(config).frozen == "teacher":  # distill, distill_on_policy: a model of its own
        teacher = distillation.teacher_model(config)
        return lambda params, batch, teacher_params: loss(params, batch, teacher_params, model, teacher, rt)
    return lambda params, batch, reference: loss(params, batch, reference, model, rt)


def lm(params, batch: dict, model: Model, rt):
    """(sum of loss_weight x cross-entropy, sum of weights, the model's aux scalars)."""
    return model.loss_fn(params, batch, rt)


sft = lm  # SFT is the LM objective on weights that the chat template set


def _next_token(params, batch: dict, reference, model: Model, rt):
    """lm and sft in the signature of the others (no frozen model)."""
    return lm(params, batch, model, rt)


def target_log_probs(params, batch: dict, model: Model, rt, temperature: float = 1.0):
    """(log p(target) [B, T] float32, aux) under `params`, p = softmax(logits / temperature); a batch that carries
    `routed_experts` (GRPO's routing replay) runs the MoE layers on those experts (models/moe/replay.py)."""
    logits, aux = model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], rt,
                                batch.get("routed_experts"))
    if temperature != 1.0:
        logits = logits.astype(jnp.float32) / temperature
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return target - log_z, aux


def pair_sums(log_probs, batch: dict):
    """Per pair (B x (T // 2 + 1) slots, most empty): (chosen log-prob, rejected log-prob, is a whole pair)."""
    weights = batch["loss_weights"].astype(jnp.float32)
    rows, length = weights.shape
    slots = length // 2 + 1
    pair = (batch["segment_ids"] + 1) // 2                          # segments 2k-1, 2k -> pair k; padding -> 0
    ids = (jnp.arange(rows)[:, None] * slots + pair).reshape(-1)

    def total(values):
        return jax.ops.segment_sum(values.reshape(-1), ids, num_segments=rows * slots)

    chosen = total(jnp.where(weights > 0, weights * log_probs, 0.0))
    rejected = total(jnp.where(weights < 0, -weights * log_probs, 0.0))
    whole = (total((weights > 0).astype(jnp.float32)) > 0) & (total((weights < 0).astype(jnp.float32)) > 0)
    return chosen, rejected, whole


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float):
    """Per-pair DPO loss and the implicit rewards beta x (log pi - log ref)."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(margin) - label_smoothing * jax.nn.log_sigmoid(-margin)
    return loss, chosen_reward, rejected_reward


def dpo(params, batch: dict, reference, model: Model, rt):
    """(sum of per-pair DPO losses, number of pairs, metrics); `reference` is never differentiated."""
    config = model.config
    policy_lp, aux = target_log_probs(params, batch, model, rt)
    ref_lp, _ = target_log_probs(jax.lax.stop_gradient(reference), batch, model, rt)
    pc, pr, whole = pair_sums(policy_lp, batch)
    rc, rr, _ = pair_sums(jax.lax.stop_gradient(ref_lp), batch)
    loss, chosen_reward, rejected_reward = dpo_loss(pc, pr, rc, rr, config.dpo_beta, config.dpo_label_smoothing)
    mask = whole.astype(jnp.float32)
    pairs = jnp.sum(mask)

    def mean(x):
        return jnp.sum(x * mask) / jnp.maximum(pairs, 1.0)

    metrics = {
        **aux,
        "dpo_reward_accuracy": mean((chosen_reward > rejected_reward).astype(jnp.float32)),
        "dpo_reward_margin": mean(chosen_reward - rejected_reward),
        "dpo_chosen_reward": mean(chosen_reward),
        "dpo_rejected_reward": mean(rejected_reward),
        "dpo_chosen_logp": mean(pc),
        "dpo_rejected_logp": mean(pr),
    }
    return jnp.sum(loss * mask), pairs, metrics


def distill(params, batch: dict, teacher_params, model: Model, teacher: Model, rt):
    """(sum of alpha T^2 KL + (1 - alpha) CE over weighted targets, their weight, metrics); the teacher is
    never differentiated (models/distill.py stops its gradient)."""
    config = model.config
    loss, weight, aux, kl_sum, ce_sum = distill_lib.loss_fn(model, params, teacher, teacher_params, batch, rt,
                                                            config.distill_alpha, config.distill_temperature)
    per_target = jnp.maximum(weight, 1.0)
    return loss, weight, {**aux, "distill_kl": kl_sum / per_target, "distill_ce": ce_sum / per_target}
def distill_on_policy(params, batch: dict, teacher_params, model: Model, teacher: Model, rt):
    """(sum over the sampled completions' tokens of KL(student || teacher) over the vocabulary, their number,
    metrics): on-policy distillation's loss (models/distill.reverse_terms), both models' logits at the sampler's
    temperature, the distribution the student drew the completions from; the teacher is never differentiated.
    The train step divides by the batch's completion tokens: TRL's DistillationTrainer (beta=1) normalization."""
    temperature = sampling.sampling_settings(model.config)["temperature"]
    (kl_sum, entropy_sum), weight, aux = distill_lib.sums(
        model, params, teacher, teacher_params, batch, rt,
        lambda s, u, targets, w: distill_lib.reverse_terms(s, u, targets, w, temperature))
    per_token = jnp.maximum(weight, 1.0)
    return kl_sum, weight, {**aux, "distill_reverse_kl": kl_sum / per_token, "distill_entropy": entropy_sum / per_token}


grpo_token_loss = policy_losses.grpo_token_loss  # the clipped per-token loss (dapo's, today's default)


def grpo(params, batch: dict, reference, model: Model, rt):
    """(the GRPO loss of grpo_loss_type, normalised as TRL normalises it: (loss sum, weight), metrics;
    training/policy_losses.py); pi, pi_old and ref are all softmax(logits / T) at the rollouts' sampling
    temperature T, the distribution the completions were drawn from (else the update is off-policy for every
    T != 1)."""
    config = model.config
    s = policy_losses.settings(config)
    temperature = sampling.sampling_settings(config)["temperature"]
    log_probs, aux = target_log_probs(params, batch, model, rt, temperature)
    ref_log_probs = None
    if config.grpo_beta > 0:
        ref_log_probs = jax.lax.stop_gradient(
            target_log_probs(jax.lax.stop_gradient(reference), batch, model, rt, temperature)[0])
    weights = batch["loss_weights"].astype(jnp.float32)
    loss, parts = policy_losses.token_loss(log_probs, batch["old_log_probs"], ref_log_probs, batch["advantages"],
                                           weights, s, batch.get("tis_weights"))  # rollout workers' correction
    rows = policy_losses.real_rows(batch["segment_ids"])
    tokens = jnp.sum(weights)
    metrics = {**aux, **policy_losses.metrics(parts, batch["advantages"], weights, rows, s),
               "grpo_log_ratio": jnp.sum(jnp.where(weights > 0, log_probs - batch["old_log_probs"], 0.0) * weights)
               / jnp.maximum(tokens, 1.0)}
    loss_sum, weight = policy_losses.normalised(loss, weights, rows, s)
    return loss_sum, weight, metrics


# Each objective row's loss (config/objectives.py declares the rows; tests/training/test_objectives.py checks that every
# row has one). distill's also needs the teacher's config: make builds it.
LOSSES = {"lm": _next_token, "sft": _next_token, "dpo": dpo, "grpo": grpo, "distill": distill,
          "distill_on_policy": distill_on_policy}

"""Knowledge distillation's loss: a student's logits pulled towards a frozen teacher's, mixed with the
next-token loss (Hinton et al. 2015; MaxText's distill_alpha and distill_temperature).

Per target token t with loss weight w, student logits s and teacher logits u (the same vocabulary),
at temperature T and mixing weight alpha:

    p_T = softmax(u / T)        q_T = softmax(s / T)
    kl  = sum_v p_T[v] (log p_T[v] - log q_T[v])                 forward KL(teacher || student)
    ce  = logsumexp(s) - s[target]                               the next-token loss, at temperature 1
    loss = sum_t w_t (alpha T^2 kl_t + (1 - alpha) ce_t)

On-policy distillation (objective=distill_on_policy: training/on_policy.py samples the rows) minimizes
instead, on the student's own completions, the reverse divergence over the whole vocabulary

    loss = sum_t w_t sum_v q_T[v] (log q_T[v] - log p_T[v])      KL(student || teacher), `reverse_terms`

with T the sampler's temperature and no T^2 (TRL's DistillationTrainer at beta=1).

The T^2 keeps the KL term's gradient (alpha T (q_T - p_T) per logit) of the same size as the
next-token loss's when T changes. alpha = 0 is the plain next-token loss; alpha = 1 learns from the
teacher alone. The teacher never gets a gradient (stop_gradient on its logits).

With num_vocab_tiling > 1 the sequence is cut into chunks and each chunk's student and teacher
logits are made, used and dropped in turn: the [B, T, V] logits of neither model exist in full. The
chunk's body is rematerialized (jax.checkpoint), so the backward pass recomputes that chunk's two
logit projections rather than keeping them: one more output-layer matmul per model than the untiled
loss, for memory that does not grow with the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models import decoder, ops
from maxtrain.parallel import context as context_parallel
from maxtrain.parallel import sharding


def terms(student_logits, teacher_logits, targets, weights, temperature: float):
    """(sum of w x kl, sum of w x ce) over tokens, float32; logits [..., V] float32, targets and weights [...]."""
    weights = weights.astype(jnp.float32)
    teacher_log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits) / temperature, axis=-1)
    student_log_q = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(teacher_log_p) * (teacher_log_p - student_log_q), axis=-1)
    return jnp.sum(kl * weights), ops.cross_entropy(student_logits, targets, weights)


def mix(kl_sum, ce_sum, alpha: float, temperature: float):
    """alpha T^2 kl + (1 - alpha) ce: what training minimizes."""
    return alpha * temperature ** 2 * kl_sum + (1.0 - alpha) * ce_sum


def reverse_terms(student_logits, teacher_logits, targets, weights, temperature: float):
    """(sum of w x KL(student || teacher), sum of w x the student's entropy) over tokens, float32, both models'
    distributions softmax(logits / T) over the whole vocabulary; on-policy distillation's per-token loss
    (objective=distill_on_policy). `targets` (the sampled tokens) are not read: the divergence is exact over the
    vocabulary, not estimated from the sampled token. The entropy is a metric (no gradient)."""
    del targets
    weights = weights.astype(jnp.float32)
    teacher_log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature, -1)
    student_log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    q = jnp.exp(student_log_q)
    kl = jnp.sum(q * (student_log_q - teacher_log_p), axis=-1)
    entropy = jax.lax.stop_gradient(-jnp.sum(q * student_log_q, axis=-1))
    return jnp.sum(kl * weights), jnp.sum(entropy * weights)


def loss_fn(model, params, teacher, teacher_params, batch: dict, rt, alpha: float, temperature: float):
    """(mixed loss sum, weight sum, the student's aux, kl sum, ce sum), float32, of the bound student `model`
    and `teacher` (models/model.py). The teacher runs with the student's runtime choices; its aux (a mixture
    of experts' balance losses) is dropped."""
    (kl_sum, ce_sum), weight, aux = sums(model, params, teacher, teacher_params, batch, rt,
                                         lambda *a: terms(*a, temperature))
    return mix(kl_sum, ce_sum, alpha, temperature), weight, aux, kl_sum, ce_sum


def sums(model, params, teacher, teacher_params, batch: dict, rt, chunk_sums):
    """(the two sums of chunk_sums(student logits, teacher logits, targets, weights) over the batch, weight sum,
    the student's aux): both models' logits made chunk by chunk with num_vocab_tiling > 1 (see above)."""
    cp = sharding.ways("length")
    if cp > 1:  # sums over tokens do not depend on their order (decoder.loss_fn)
        batch = context_parallel.to_layout(batch, cp, reorder=model.config.context_parallel_reorder_strategy)
    weights = batch["loss_weights"].astype(jnp.float32)
    tokens = (batch["inputs"], batch["positions"], batch["segment_ids"])
    x, aux = decoder.hidden(model, params, *tokens, rt)
    teacher_params = jax.lax.stop_gradient(teacher_params)
    x_teacher, _ = decoder.hidden(teacher, teacher_params, *tokens, rt)
    x_teacher = jax.lax.stop_gradient(x_teacher)
    head = {k: v for k, v in params.items() if k != "layers"}
    teacher_head = {k: v for k, v in teacher_params.items() if k != "layers"}

    def chunk_terms(h, xs, xt, tc, wc):
        student_logits = model.family.logits(h, xs, model.config, rt)
        teacher_logits = teacher.family.logits(teacher_head, xt, teacher.config, rt)
        return chunk_sums(student_logits, teacher_logits, tc, wc)

    if rt.vocab_tiles > 1:
        both = tiled(chunk_terms, head, (x, x_teacher, batch["targets"], weights), rt.vocab_tiles)
    else:
        both = chunk_terms(head, x, x_teacher, batch["targets"], weights)
    return both, jnp.sum(weights), aux


def tiled(chunk_terms, head, per_token: tuple, tiles: int):
    """The sums of chunk_terms(head, *chunk) over `tiles` sequence chunks of the [B, T, ...] arrays in
    per_token, one chunk's logits at a time (rematerialized in the backward pass)."""
    b, t = per_token[-1].shape
    if t % tiles:
        raise ValueError(f"sequence length {t} is not a multiple of num_vocab_tiling={tiles}")

    def chunks(a):  # [B, T, ...] -> [tiles, B, T / tiles, ...]
        return jnp.moveaxis(a.reshape((b, tiles, t // tiles) + a.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(carry, c):
        kl, ce = chunk_terms(head, *c)
        return (carry[0] + kl, carry[1] + ce), None

    zero = jnp.float32(0.0)
    (kl_sum, ce_sum), _ = jax.lax.scan(body, (zero, zero), tuple(chunks(a) for a in per_token))
    return kl_sum, ce_sum

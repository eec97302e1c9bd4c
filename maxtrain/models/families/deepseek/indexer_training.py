"""Training DeepSeek-V3.2's lightning indexer as DeepSeek did (indexer_training): the dense warm-up and the sparse
stage, each a KL loss from the attention's head-averaged distribution to the softmax of the indexer's scores.

    dense_warmup   attention over every visible key (the main model frozen by the optimizer, config/mla_checks.py);
                   KL over those keys, the target [B, heads, T, S] float32 while computed (the plain form)
    sparse         attention over the index_topk keys of highest score; KL over those keys alone: beyond
                   index_topk tokens selected.py's blocks (no [T, S] array, SELECTED_TRAINING), at or below it
                   every key is kept and the plain form runs

The indexer's inputs are detached and the target carries no gradient, so the loss trains the indexer's weights
alone; the language-model loss never reaches them. indexer_dtype sets the precision of the scores that choose the
keys alone (no gradient: the top-k has none); the KL scores them in float32 with its gradient, so the quantization
needs no straight-through estimator and the indexer learns from float32 scores, as at indexer_dtype=float32. Under context parallelism (all_gather) the plain form's masks
compare the tokens' original indices (selected_context.visible) and selected.py's blocks run per device on its own
queries (selected_context.attention).
"""

from __future__ import annotations

import functools

import jax

from maxtrain.models.families.deepseek import indexer, mla, selected_context, shared_topk

# The sparse stage of indexer_training beyond index_topk tokens: selected.py over each query's selected keys alone
# (True), or the plain form under the top-k mask ([B, heads, T, T] float32 for the KL's target; the tests and
# scripts/indexer_memory.py compare the two).
SELECTED_TRAINING = True


def attention(normed, p, inputs, config, rt, selected_keys):
    """MLA with the indexer trained (indexer_training): its scores I [B, T, S] computed with its weights' gradient
    (its inputs detached); "dense_warmup": attention over every visible key, "sparse": over the index_topk keys of
    highest I (every key at or below index_topk tokens). aux["indexer_kl"] is KL(attention's head-averaged
    distribution || softmax(I)) over those keys, its mean over the layers, and aux["indexer_loss"] that times
    indexer_loss_weight, which the objective adds. With GLM-5's shared layers (indexer_types) only the full layers
    have an indexer, each trained toward its own layer's attention (the KL averages over them); in the sparse stage
    its choice goes on in aux["state"] to the shared layers after it, which attend to those keys; in the dense
    warm-up they attend to every key. selected_keys: the family's selected-key attention (deepseek._selected_keys),
    which the sparse stage beyond index_topk tokens runs with its KL over each query's selected keys."""
    full_layers = shared_topk.shared_layers(config).count(False)  # the layers with an indexer
    if config.indexer_training == "sparse" and normed.shape[1] > config.index_topk and SELECTED_TRAINING:
        kernel = rt.backend if rt.attention == "flash" else None  # over each query's selected keys alone
        h, aux = mla.attention(normed, p, inputs, config, rt, selected_keys=functools.partial(
            selected_keys, normed, p, inputs.segment_ids, config, kernel, trained=True,
            hand_on=inputs.state is not None))
        kl = aux.pop("indexer_kl") / full_layers  # summed over the full layers by the decoder: their mean
        return h, {**aux, "indexer_kl": kl, "indexer_loss": config.indexer_loss_weight * kl}
    rope, seg, reorder = inputs.rope["global"], inputs.segment_ids, config.context_parallel_reorder_strategy
    visible = selected_context.visible(seg, reorder)
    interleave = config.index_rope_interleave
    index_q, index_w = indexer.queries(normed, mla.query_latent(normed, p, config, rt), p, rope, interleave,
                                       trained=True)
    index_k = indexer.keys(normed, p, rope, interleave, trained=True)
    index = indexer.combine(index_q, index_w, index_k)  # float32, with its gradient: the KL's
    kept = choice = None
    if config.indexer_training == "sparse" and normed.shape[1] > config.index_topk:
        at = index if config.indexer_dtype == "float32" else indexer.combine(index_q, index_w, index_k,
                                                                              config.indexer_dtype)
        choice = indexer.choose(jax.lax.stop_gradient(at), visible, config.index_topk)
        kept = shared_topk.mask(choice, index.shape[-1])  # the chosen keys, all of them visible
    h, aux = mla.attention(normed, p, inputs, config, rt, keys_kept=None if kept is None else lambda *_: kept,
                           attention_target=visible)
    kl = indexer.kl_to_attention(aux.pop("attention_target"), index, visible if kept is None else kept, seg)
    kl = kl / full_layers  # summed over them by the decoder: their mean
    aux = {**aux, "indexer_kl": kl, "indexer_loss": config.indexer_loss_weight * kl}
    if choice is not None and inputs.state is not None:  # GLM-5's shared layers after this one attend to its keys
        aux["state"] = selected_context.in_sequence_order(choice, reorder)
    return h, aux

"""Multi-token prediction (DeepSeek-V3, section 2.2): D sequential modules, each predicting one token further.

    h^0 = the main model's final hidden states, before its final norm
    for k = 1 .. D (mtp_num_layers), at each position i:
        h'_i  = W_k [rmsnorm_e(Emb(t_{i+k})) ; rmsnorm_h(h^{k-1}_i)]     W_k: eh_proj [2D -> D]
        h^k   = block_k(h')                                            a block like the model's last layer (MLA + MoE)
        L_k   = cross-entropy of head(rmsnorm_k(h^k_i)) against t_{i+k+1}
    mtp_loss = mtp_loss_scaling_factor / D x sum_k L_k                 added to the objective

The embedding table and the output head are the model's own (no copies in maxtrain's params); each module
has its enorm, hnorm, eh_proj, final_norm (Hugging Face's shared_head.norm) and its block's weights, stacked
on a leading "layers" axis of D. The concatenation puts the embedding first, as DeepSeek's checkpoints (and
vLLM reading them) do; the paper writes the hidden state first.

Packing. With inputs t_i and targets t_{i+1} of a packed row, module k reads inputs[i + k] and predicts
targets[i + k]; position i counts (weight loss_weights[i + k]) only when i + k is still in row i's document
(segment_ids[i + k] == segment_ids[i]); the rest of the row is weight 0. A counted position attends only to
earlier positions of its document, which are counted too, so no document sees another's tokens.

L_k is a mean over its counted positions. The module's MoE block adds its balance losses to the model's
(as one more MoE layer); its per-layer load figures and expert counts are not reported, and its router's
selection bias stays as loaded (sigmoid_groups.update_router_bias: the sign rule moves the main layers' only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models import blocks, ops
from maxtrain.models.aux_names import PER_LAYER
from maxtrain.models.params import dense, stacked
from maxtrain.parallel.sharding import shard

PER_MODULE = ("enorm", "hnorm", "eh_proj", "final_norm")  # beside the block's own weights


def specs(config, block_specs: dict) -> dict:
    """The D modules' parameters: their own four beside one block's (block_specs, unstacked), stacked."""
    d = config.base_emb_dim
    one = {"enorm": blocks.norm_spec(config), "hnorm": blocks.norm_spec(config),
           "eh_proj": dense((2 * d, d), (None, "embed"), 2 * d), "final_norm": blocks.norm_spec(config),
           **block_specs}
    return stacked(one, config.mtp_num_layers)


def shifted(a, k: int, fill):
    """a [B, T] moved k positions left: out[:, i] = a[:, i + k], `fill` past the end."""
    return jnp.concatenate([a[:, k:], jnp.full((a.shape[0], k), fill, a.dtype)], axis=1)


def depth_batch(batch: dict, k: int) -> dict:
    """Module k's tokens, targets and weights at each position i (the packing rule above)."""
    same = shifted(batch["segment_ids"], k, -1) == batch["segment_ids"]
    weights = jnp.where(same, shifted(batch["loss_weights"].astype(jnp.float32), k, 0), 0.0)
    return {"inputs": shifted(batch["inputs"], k, 0), "targets": shifted(batch["targets"], k, 0),
            "loss_weights": weights}


def loss(x, mtp_params: dict, batch: dict, config, rt, *, embed, block, head_loss) -> dict:
    """{"mtp_loss": the objective's term, "mtp_ce": (1/D) sum_k L_k (comparable with the loss), and the modules'
    block aux summed}. embed(tokens) -> [B, T, D]; block(x, p) -> (x, aux); head_loss(final_norm, x, targets,
    weights) -> the sum of weight x cross-entropy through the shared head."""
    eps, depth = config.normalization_layer_epsilon, config.mtp_num_layers
    ce_sum, aux_sum = jnp.float32(0.0), {}
    h = x
    for k in range(1, depth + 1):
        p = jax.tree.map(lambda a, k=k: a[k - 1], mtp_params)
        part = depth_batch(batch, k)
        e = blocks.rms_norm(embed(part["inputs"]), p["enorm"], eps)
        both = jnp.concatenate([e, blocks.rms_norm(h, p["hnorm"], eps).astype(e.dtype)], axis=-1)
        h = shard(ops.dense(both, p["eh_proj"].astype(rt.dtype), backend=rt.backend), ("batch", "length", "embed"))
        h, aux = block(h, {n: v for n, v in p.items() if n not in PER_MODULE})
        for name, value in aux.items():
            if not name.startswith(PER_LAYER):  # per-layer figures of the main stack only
                aux_sum[name] = aux_sum[name] + value if name in aux_sum else value
        weights = part["loss_weights"]
        ce_sum = ce_sum + head_loss(p["final_norm"], h, part["targets"], weights) / jnp.maximum(jnp.sum(weights), 1.0)
    ce = ce_sum / depth
    return {**aux_sum, "mtp_loss": config.mtp_loss_scaling_factor * ce, "mtp_ce": ce}

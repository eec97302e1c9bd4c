"""The names of a layer's aux entries that the decoder treats apart (models/decoder.py sums the others).

    PER_LAYER + name             reported per layer, not summed: "<name>/layer_<i>" (per_layer_name)
    PER_LAYER + STEP_STATS + ... arrays, not metrics: statistics of the step that training reads to update state
                                 outside the gradient (models/moe/: the expert counts that move the router's
                                 selection bias); the train step takes them out of the metrics and sums
                                 them over its micro-batches
    PER_LAYER + STEP_MAX + ...   step statistics that are maxima (models/qk_clip.py: each head's largest
                                 attention logit): the train step takes their max over the micro-batches,
                                 and reports the max over their last axis as a metric ("max_attention_logit/
                                 layer_03")

Here, below the decoder and the blocks that write such entries (models/moe/), so that neither imports the other.
"""

from __future__ import annotations

import jax.numpy as jnp

PER_LAYER = "per_layer/"  # aux entries named with this prefix are reported per layer, not summed
STEP_STATS = "step_stats/"  # (after PER_LAYER) the step's statistics for updates outside the gradient
STEP_MAX = STEP_STATS + "max_"  # (after PER_LAYER) a statistic that is a maximum, not a sum
# Each query head's largest attention logit in a layer [N] (models/attention/max_logits.py), for QK-clip
MAX_ATTENTION_LOGIT = PER_LAYER + STEP_MAX + "attention_logit"


def per_layer_name(name: str, layer: int, num_layers: int) -> str:
    """The aux key of a PER_LAYER entry `name` of one layer: "moe_load_max/layer_03"."""
    return f"{name[len(PER_LAYER):]}/layer_{layer:0{len(str(num_layers - 1))}d}"


def reduce_over_micro_batches(name: str, values):
    """One step's statistic `name` from its micro-batches' values [micro-batches, ...]: their max for a STEP_MAX
    entry, else their sum."""
    return jnp.max(values, axis=0) if name.startswith(STEP_MAX) else jnp.sum(values, axis=0)

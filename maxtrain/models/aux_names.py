"""The names of a layer's aux entries that the decoder treats apart (models/decoder.py sums the others).

    PER_LAYER + name             reported per layer, not summed: "<name>/layer_<i>" (per_layer_name)
    PER_LAYER + STEP_STATS + ... arrays, not metrics: statistics of the step that training reads to update state
                                 outside the gradient (models/moe/: the expert counts that move the router's
                                 selection bias); the train step takes them out of the metrics

Here, below the decoder and the blocks that write such entries (models/moe/), so that neither imports the other.
"""

from __future__ import annotations

PER_LAYER = "per_layer/"  # aux entries named with this prefix are reported per layer, not summed
STEP_STATS = "step_stats/"  # (after PER_LAYER) the step's statistics for updates outside the gradient


def per_layer_name(name: str, layer: int, num_layers: int) -> str:
    """The aux key of a PER_LAYER entry `name` of one layer: "moe_load_max/layer_03"."""
    return f"{name[len(PER_LAYER):]}/layer_{layer:0{len(str(num_layers - 1))}d}"

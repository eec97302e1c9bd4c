"""The model, bound once: a family's contract, the config it runs with and its layers' kinds.

    model = Model.bind(config)                 # the one place the family and the layer kinds are resolved
    params = model.init_params(key)
    logits, aux = model.forward(params, tokens, positions, segment_ids, rt)
    loss_sum, weight_sum, aux = model.loss_fn(params, batch, rt)

`Model.bind` looks `config.decoder_block` up in the families (models/families/) and asks the family for
its `layer_types` one time; everything below it (the decoder, decoding's cache, FLOPs, the MoE router's
update, pipeline stages, Hugging Face conversion, the summaries) reads `model.family` and
`model.layer_types` and never resolves either from the config again (tests/house/test_house.py fails when a
function does). The builder binds the run's model (training/builder.py) and passes it on; a tool binds
the model of the checkpoint it loads.

The config stays reachable as `model.config`: the blocks read their hyperparameters (eps, heads, RoPE)
from it. A Model is frozen; its derived figures (declarations, counts) are computed on first use and kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from maxtrain.models import decoder, moe, qk_clip
from maxtrain.models.moe import sigmoid_groups
from maxtrain.models import params as params_lib
from maxtrain.models.contract import FamilyModel
from maxtrain.models.families import FAMILIES
from maxtrain.models.layers import LayerType


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A family bound to a config: what the decoder, decoding, conversion, FLOPs and the summaries call."""

    family: FamilyModel
    config: Any
    layer_types: tuple[LayerType, ...]

    @classmethod
    def bind(cls, config) -> "Model":
        """The model `config.decoder_block` names, with its layers' kinds resolved from `config`."""
        try:
            family = FAMILIES[config.decoder_block]
        except KeyError:
            raise ValueError(f"decoder_block={config.decoder_block!r} is not a model family; "
                             f"use one of {', '.join(FAMILIES)}") from None
        return cls(family, config, tuple(family.layer_types(config)))

    def __eq__(self, other) -> bool:  # the same family and the same config object: the same model
        return isinstance(other, Model) and self.family is other.family and self.config is other.config

    def __hash__(self) -> int:  # a static argument of jit: equal models share their compiled programs
        return hash((self.family.name, id(self.config)))

    @property
    def name(self) -> str:
        return self.family.name

    @functools.cached_property
    def param_specs(self) -> params_lib.Params:
        """The declaration of every parameter, as a nested dict of ParamSpec."""
        return self.family.param_specs(self)

    @functools.cached_property
    def num_params(self) -> int:
        return params_lib.count(self.param_specs)

    @functools.cached_property
    def num_active_params(self) -> int:
        """Parameters one token uses: all of a dense model; of a mixture of experts, K of its E experts."""
        return moe.active_params(self.param_specs, self.config)

    @property
    def is_moe(self) -> bool:
        """Whether some layer of the model is a mixture of experts."""
        return any(t.is_moe for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(t.is_moe for t in self.layer_types)

    def init_params(self, key) -> params_lib.Params:
        return params_lib.init_params(self.param_specs, key, self.config.weight_dtype)

    def forward(self, params, tokens, positions, segment_ids, rt, routing=None, images=None):
        """(logits [B, T, V] float32, aux dict of scalars) for tokens [B, T]; routing [B, T, L_moe, K]: the experts
        the MoE layers replay (routing replay), or None; images: a family with a vision tower's image inputs
        (pixel_values and its layout arrays, e.g. models/vision/qwen_images.image_inputs), with positions
        [3, B, T] for M-RoPE."""
        return decoder.forward(self, params, tokens, positions, segment_ids, rt, routing, images)

    def hidden(self, params, tokens, positions, segment_ids, rt):
        """(final hidden states [B, T, D], aux) before the logits."""
        return decoder.hidden(self, params, tokens, positions, segment_ids, rt)

    def loss_fn(self, params, batch: dict, rt):
        """(cross-entropy sum, weight sum, aux) for a batch of inputs/targets/positions/segment_ids/loss_weights."""
        return decoder.loss_fn(self, params, batch, rt)

    def init_cache(self, batch_size: int, max_length: int, dtype) -> dict:
        return decoder.init_cache(self, batch_size, max_length, dtype)

    def forward_with_cache(self, params, tokens, positions, cache: dict, index, rt, first=None,
                           record_routing: bool = False, images=None):
        return decoder.forward_with_cache(self, params, tokens, positions, cache, index, rt, first, record_routing,
                                          images)

    def flops_per_token(self, dense_attention: bool = False) -> float:
        """Training FLOPs per token from the family's formula (causal attention counted once, sliding
        windows counting only the keys attended; dense_attention=True counts every key, as a dense
        implementation computes them)."""
        return self.family.flops_per_token(self, dense_attention)

    def vision_flops(self, patches: int) -> float:
        """Training FLOPs of the image tower for one image of `patches` patches (its family's Vision.flops, the
        forward's matmuls by part): a part that trains counts 3 forwards (forward, the gradient of its input and of
        its weights); a frozen part (vision_freeze, or LoRA: the tower and the projector stay frozen) no weight
        gradient, and the gradient of its input only where a weight before it trains (a frozen tower: its forward
        alone; a projector over a frozen tower: no input gradient into the tower, projector_entry). 0 for a family
        without a tower."""
        vision = self.family.vision
        if vision is None or not self.config.vision_config or patches <= 0:
            return 0.0
        frozen = set(self.config.vision_freeze) | ({"tower", "projector"} if self.config.lora_rank else set())
        forward = vision.flops(self.config, int(patches))
        tower_trains, projector_trains = "tower" not in frozen, "projector" not in frozen
        projector, entry = forward["projector"], forward["projector_entry"]
        input_gradient = projector if tower_trains else (projector - entry) if projector_trains else 0
        return float((3 if tower_trains else 1) * forward["tower"] + (1 + projector_trains) * projector
                     + input_gradient)

    def update_outside_gradient(self, params, old_params, step_stats: dict):
        """The state a train step changes outside the gradient, after the optimizer's update (the MoE
        router's selection bias, models/moe/sigmoid_groups.py; QK-clip's scaling of the query and key weights,
        models/qk_clip.py), from the step's statistics (aux entries named models/aux_names.STEP_STATS)."""
        if self.config.indexer_training == "dense_warmup" or "language_model" in self.config.vision_freeze:
            return params  # only the indexer trains (or, vision_freeze, not the language model): nothing else moves
        params = sigmoid_groups.update_router_bias(params, old_params, step_stats, self.config, self.layer_types)
        return qk_clip.clip(params, step_stats, self.config, self.layer_types)

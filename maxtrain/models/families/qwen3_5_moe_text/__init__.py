"""Qwen3.5 mixture-of-experts models (Qwen Team 2026), their text decoder: Qwen3-Next's hybrid stack
(models/recurrent/hybrid.py) with experts in every layer (softmax top K, always renormalized) and a gated shared expert.
transformers keeps each layer's experts stacked in memory but writes (and reads) one tensor per expert and
projection, as Qwen3-Next's; a checkpoint with the stacked tensors (mlp.experts.gate_up_proj) is refused by name
(every expected tensor is named in the error). The released checkpoints are multimodal: the import reads the language model's weights and
says it left the vision tower out.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import contract, hf
from maxtrain.models.recurrent import hybrid

FAMILY = registry.FAMILIES["qwen3_5_moe_text"]


HF_NAMES = hybrid.hf_names(hybrid.QWEN3_5_LINEAR, experts={
    "w_gate": ("mlp.experts.{j}.gate_proj.weight", hf.Linear(1)),
    "w_up": ("mlp.experts.{j}.up_proj.weight", hf.Linear(1)),
    "w_down": ("mlp.experts.{j}.down_proj.weight", hf.Linear(1))})


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    # experts in every layer: no dense MLP, and transformers' Qwen3_5MoeTextConfig writes no intermediate_size
    return {**hybrid.hf_keys(config, notes, dense_mlp=False), **hybrid.experts_hf_keys(config), "norm_topk_prob": True}


def to_hf_config(keys: dict) -> dict:
    written = {**hybrid.hf_config(keys, FAMILY), **hybrid.experts_hf_config(keys)}
    return {k: v for k, v in written.items() if k != "intermediate_size"}  # the config class has no such field


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=hybrid.param_specs, layer_types=hybrid.layer_types, embed=hybrid.embed, layer=hybrid.layer,
    logits=hybrid.logits, flops_per_token=hybrid.flops_per_token, hf_names=HF_NAMES, from_hf_config=from_hf_config,
    to_hf_config=to_hf_config, layer_cache=hybrid.layer_cache)

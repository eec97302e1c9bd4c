"""Qwen3-Next (Qwen Team 2025): gated delta-net layers beside gated full attention, a mixture of experts with a
gated shared expert (models/recurrent/hybrid.py has the stack, which Qwen3.5 shares).

Hugging Face fuses, per key head, its query, key, and the values and gates z of the value heads it serves in
in_proj_qkvz, and b and a in in_proj_ba (hf_layouts.Grouped); q_proj holds each head's query then its output gate.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import contract, hf
from maxtrain.models.recurrent import hf_layouts, hybrid

FAMILY = registry.FAMILIES["qwen3_next"]


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_QKVZ = ("lin_wq", "lin_wk", "lin_wv", "lin_wz")
HF_NAMES = hybrid.hf_names(
    linear={**{p: ("linear_attn.in_proj_qkvz.weight", hf_layouts.Grouped(i, _QKVZ, "lin_wq")) for i, p in enumerate(_QKVZ)},
            "lin_wb": ("linear_attn.in_proj_ba.weight", hf_layouts.Grouped(0, ("lin_wb", "lin_wa"), "lin_wq")),
            "lin_wa": ("linear_attn.in_proj_ba.weight", hf_layouts.Grouped(1, ("lin_wb", "lin_wa"), "lin_wq"))},
    experts={"w_gate": ("mlp.experts.{j}.gate_proj.weight", hf.Linear(1)),
             "w_up": ("mlp.experts.{j}.up_proj.weight", hf.Linear(1)),
             "w_down": ("mlp.experts.{j}.down_proj.weight", hf.Linear(1))})


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    if int(config.get("num_experts") or 0) < 2:
        raise hf.ConversionError(f"num_experts={config.get('num_experts')}: a Qwen3-Next without a mixture of experts "
                                 "is not implemented")
    return {**hybrid.hf_keys(config, notes), **hybrid.experts_hf_keys(config),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "decoder_sparse_step": hf.count(config, "decoder_sparse_step", 1),
            "mlp_only_layers": [int(i) for i in (config.get("mlp_only_layers") or [])]}


def to_hf_config(keys: dict) -> dict:
    return {**hybrid.hf_config(keys, FAMILY), **hybrid.experts_hf_config(keys),
            "norm_topk_prob": keys["norm_topk_prob"], "decoder_sparse_step": keys["decoder_sparse_step"],
            "mlp_only_layers": list(keys["mlp_only_layers"])}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=hybrid.param_specs, layer_types=hybrid.layer_types, embed=hybrid.embed, layer=hybrid.layer,
    logits=hybrid.logits, flops_per_token=hybrid.flops_per_token, hf_names=HF_NAMES, from_hf_config=from_hf_config,
    to_hf_config=to_hf_config, layer_cache=hybrid.layer_cache)

"""DeepSeek-V4's tensors as save_pretrained writes them (DeepSeek's own names: attn.wq_a, ffn.experts.<e>.w1, ...,
under model.; head.weight at the top) -> the module names model.py reads (transformers' in-memory names), with the
per-expert matrices stacked: gate_up_proj [E, 2I, D] = [w1 ; w3] per expert, down_proj [E, D, I] = w2; to_saved is
the inverse (the exact names and tensors save_pretrained wrote, checked in tests/models/test_deepseek_v4_parts.py).

transformers 5.24 writes a mix: its renames anchored at the name's start (embed, head, hc_head_*) do not match
under model., so model.embed_tokens.weight, model.hc_head.hc_* and model.norm.weight keep the in-memory names
while head.weight loses its lm_ prefix; the layers' tensors all take DeepSeek's names. Both spellings read here."""

from __future__ import annotations

import re

import numpy as np

# (pattern, replacement), applied in order to each name; the model-level ones are anchored.
_RENAMES = (
    (r"^head\.weight$", "lm_head.weight"),
    (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
    (r"^model\.hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


def rename(name: str) -> str:
    if not name.startswith("model.") and name != "head.weight":
        name = "model." + name
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def from_saved(tensors: dict) -> dict:
    """{saved name: array} -> {module name: array} with the experts stacked."""
    out, experts = {}, {}
    for name, value in tensors.items():
        name = rename(name)
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = np.asarray(value)
        else:
            out[name] = value
    for prefix, w in experts.items():
        n = len(w["w1"])
        out[prefix + ".gate_up_proj"] = np.stack([np.concatenate([w["w1"][e], w["w3"][e]], 0) for e in range(n)])
        out[prefix + ".down_proj"] = np.stack([w["w2"][e] for e in range(n)])
    return out


_BACK = (
    (r"^lm_head\.weight$", "head.weight"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.(self_attn|compressor)\.kv_norm\.", r".\1.norm."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)


def to_saved(params: dict) -> dict:
    """The inverse of from_saved: {module name: array} -> {saved name: array}, experts split per expert."""
    out = {}
    for name, value in params.items():
        value = np.asarray(value)
        if name.endswith(".experts.gate_up_proj"):
            base = name[:-len("gate_up_proj")]
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[_back(base + f"{e}.w1.weight")] = value[e, :half]
                out[_back(base + f"{e}.w3.weight")] = value[e, half:]
        elif name.endswith(".experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(value.shape[0]):
                out[_back(base + f"{e}.w2.weight")] = value[e]
        else:
            out[_back(name)] = value
    return out


def _back(name: str) -> str:
    for pattern, repl in _BACK:
        name = re.sub(pattern, repl, name)
    return name

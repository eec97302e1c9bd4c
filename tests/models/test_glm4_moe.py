"""The glm4_moe family's own parts (GLM-4.5): config.json read as transformers reads it (partial_rotary_factor
where it is stated, and its default), its next-token-prediction layers imported with keep_mtp and left out of
an export, decoding with partial RoPE from the KV cache, and a train step with its MTP module.

Parity with transformers' Glm4Moe (partial RoPE, qk-norm, biases, groups, dense-first layers) is in
test_families.py; parameter counts and FLOPs in test_presets.py; bad settings in bad_inputs/.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY

from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.config import load_config, with_overrides
from maxtrain.models import sampling
from maxtrain.models.families import glm4_moe

# 2 layers (1 dense, 1 MoE) of 8 experts in 4 groups, 2 chosen from the best 2 groups, 1 shared expert; RoPE on
# half of each 16-wide head, qk-norm, q/k/v biases.
GLM4_MOE = ["decoder_block=glm4_moe", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
            "first_num_dense_layers=1", "shared_experts=1", "n_routing_groups=4", "topk_routing_group=2",
            "routed_scaling_factor=2.5", "routed_bias=true", "partial_rotary_factor=0.5", "use_qk_norm=true",
            "attention_bias=true", "load_balance_loss_weight=0"]


def tiny(*overrides):
    return load_config(with_overrides(with_overrides([BASE_YML, *TINY], *GLM4_MOE), *overrides))


def hf_fields(**changes) -> dict:
    keys = {k: getattr(tiny(), k) for k in model_keys.MODEL_KEYS}
    return {**glm4_moe.to_hf_config(keys), **changes}


@pytest.mark.parametrize("where, factor", [("rope_parameters", 0.25), ("top level", 0.75), ("absent", 0.5)])
def test_the_rotary_factor_is_read_where_transformers_reads_it(where, factor):
    fields = hf_fields()
    rope = {k: v for k, v in fields["rope_parameters"].items() if k != "partial_rotary_factor"}
    if where == "rope_parameters":  # the RoPE parameters' own wins over a top-level one
        fields = {**fields, "rope_parameters": {**rope, "partial_rotary_factor": factor}, "partial_rotary_factor": 0.75}
    elif where == "top level":
        fields = {**fields, "rope_parameters": rope, "partial_rotary_factor": factor}
    else:  # transformers' Glm4MoeConfig default
        fields = {**fields, "rope_parameters": rope}
    assert convert.model_keys(fields)["partial_rotary_factor"] == factor


def test_the_config_round_trips_through_config_json():
    keys = convert.model_keys(hf_fields())
    assert {k: keys[k] for k in model_keys.MODEL_KEYS} == {k: getattr(tiny(), k) for k in model_keys.MODEL_KEYS}


def test_the_next_token_prediction_layer_is_imported_with_keep_mtp_and_left_out_of_the_export(tmp_path):
    """A tiny GLM-4.5 checkpoint with its MTP layer at model.layers.2 (the MoE layer's names, enorm, hnorm, eh_proj,
    shared_head.norm, and copies of the embedding and head): keep_mtp reads it into params["mtp"]; the export
    writes only the main model's tensors."""
    config = tiny("mtp_num_layers=1")
    rng = np.random.default_rng(3)
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), Model.bind(config).param_specs,
                          is_leaf=is_spec)
    main = convert.to_hf(params, {**keys, "mtp_num_layers": 0}, np.float32)
    d = config.base_emb_dim
    module = {n.replace("model.layers.1.", "model.layers.2."): rng.normal(size=w.shape).astype(np.float32)
              for n, w in main.items() if n.startswith("model.layers.1.")}
    module.update({f"model.layers.2.{n}": rng.normal(size=s).astype(np.float32) for n, s in (
        ("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
        ("shared_head.norm.weight", (d,)))})
    module["model.layers.2.embed_tokens.weight"] = main["model.embed_tokens.weight"]
    module["model.layers.2.shared_head.head.weight"] = main["lm_head.weight"]
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    safetensors_files.write(str(hf_dir / "model.safetensors"), {**main, **module})
    hf_config = {**convert.hf_config({**keys, "mtp_num_layers": 0}, None, "float32"), "num_nextn_predict_layers": 1}
    (hf_dir / "config.json").write_text(json.dumps(hf_config))

    keys = convert.import_hf(str(hf_dir), str(tmp_path / "with"), log=lambda *_: None, keep_mtp=True)
    assert keys["mtp_num_layers"] == 1
    got = checkpoint_files.read_params(str(tmp_path / "with"))["mtp"]
    np.testing.assert_array_equal(got["eh_proj"][0], module["model.layers.2.eh_proj.weight"].T)
    np.testing.assert_array_equal(got["enorm"][0], module["model.layers.2.enorm.weight"])
    np.testing.assert_array_equal(got["final_norm"][0], module["model.layers.2.shared_head.norm.weight"])
    np.testing.assert_array_equal(got["bq"][0].ravel(), module["model.layers.2.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(got["k_norm"][0], module["model.layers.2.self_attn.k_norm.weight"])
    np.testing.assert_array_equal(got["w_up"][0, 5], module["model.layers.2.mlp.experts.5.up_proj.weight"].T)
    np.testing.assert_array_equal(got["shared_down"][0], module["model.layers.2.mlp.shared_experts.down_proj.weight"].T)
    np.testing.assert_array_equal(got["router_bias"][0], module["model.layers.2.mlp.gate.e_score_correction_bias"])

    notes = []
    convert.export_hf(str(tmp_path / "with"), str(tmp_path / "exported"), log=notes.append)
    exported = safetensors_files.read_model_dir(str(tmp_path / "exported"))
    assert sorted(exported) == sorted(main) and any("not exported" in n for n in notes)


@pytest.mark.slow  # ~18 s on the shared 2-core CPU (two compiles of the sampler and the forward)
def test_decoding_with_partial_rope_from_the_cache_equals_the_full_forward():
    config = tiny("max_target_length=16")
    rt = Runtime.from_config(config)
    params = jax.jit(lambda key: Model.bind(config).init_params(key))(jax.random.key(3))
    prompt = [5, 17, 3, 99]
    new = [int(t) for t in sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=6)]
    ids = jnp.asarray([prompt + new])  # the full forward over prompt + generated: each token its argmax
    logits = jax.jit(lambda p: Model.bind(config).forward(p, ids, jnp.arange(10)[None], jnp.ones_like(ids), rt)[0])(params)
    assert [int(t) for t in jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1)] == new


# zai-org/GLM-4.5-Air's config.json (transformers 4.54's form: partial_rotary_factor and rope_theta at the top
# level, rope_scaling null), as published.
AIR_CONFIG = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
              "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
              "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
              "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
              "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
              "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
              "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
              "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "use_cache": True, "use_qk_norm": False, "vocab_size": 151552}


def test_the_released_air_config_reads_as_the_preset():
    preset = load_config([BASE_YML, "model_name=glm-4.5-air"])
    keys = convert.model_keys(AIR_CONFIG)
    assert {k: keys[k] for k in model_keys.MODEL_KEYS} == {k: getattr(preset, k) for k in model_keys.MODEL_KEYS}

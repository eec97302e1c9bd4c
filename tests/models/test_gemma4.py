"""Gemma 4 text (decoder_block gemma4_text) against Hugging Face transformers' Gemma4ForCausalLM.

Two random tiny models cover every feature maxtrain implements: full-attention layers with their own head
dim and kv heads, keys as values, proportional RoPE on a quarter of their head, per-layer input embeddings,
a final soft-cap, random layer scalars (case "dense"); shared-KV layers with double-wide MLPs and the MoE
block beside each dense MLP (case "shared_kv-moe"). Each is imported with the user's command, compared
with `check_logits --hf` (float32, <= 1e-5 relative), checked against a negative control (the feature
switched off fails the comparison), run again with the layers scanned (the per-layer inputs and the
shared keys and values pass through lax.scan), then exported: every tensor bitwise the original, the
config.json the original's, and transformers' logits from the export exactly the original's.

Needs the [hf] extra (torch, transformers); skipped with that reason without it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import check_logits
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.runtime import Runtime
from maxtrain import config as config_lib
from maxtrain.checkpointing import adoption, convert, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.models import rope as rope_lib

from ckpt_helpers import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")

LENGTH = 40  # longer than the 6-token window
SIX_LAYERS = ["sliding_attention", "full_attention"] * 3
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, vocab_size=300, vocab_size_per_layer_input=300, sliding_window=6,
              layer_types=SIX_LAYERS, hidden_size_per_layer_input=0)
# case: (config fields, maxtrain keys that switch the case's feature off)
CASES = {
    "dense": (dict(num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8,
                   final_logit_softcapping=5.0), {"rope_proportion": 1.0}),
    # (transformers' shared-KV layers need the per-layer inputs: without them its forward fails)
    "shared_kv-moe": (dict(num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
                           top_k_experts=2, moe_intermediate_size=24, hidden_size_per_layer_input=8),
                      {"num_experts_per_tok": 1}),
}


def make_model(fields: dict, seed: int = 0):
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**COMMON, **fields})).eval()
    torch.manual_seed(seed)
    with torch.no_grad():  # random everything; q/k norm scales below 1 keep the unscaled scores moderate
        for name, p in model.named_parameters():
            qk = "q_norm" in name or "k_norm" in name
            p.copy_(0.4 + 0.1 * torch.randn_like(p) if qk else 1.0 + 0.3 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # a buffer, saved with the weights
                b.copy_(0.5 + torch.rand_like(b))
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def relative_error(ours, theirs) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def ours(out_dir, tokens, scan: bool = False, **changes) -> np.ndarray:
    config = adoption.adopt_model_settings(config_lib.load_config(
        [str(REPO / "configs" / "base.yml"), f"load_parameters_path={out_dir}", "attention=dot_product",
         "dtype=float32"]), log=lambda *a: None).replace(**changes)
    rt = Runtime.from_config(config)
    if scan:
        rt = dataclasses.replace(rt, unroll_layers=False, remat_policy="full")
    params = checkpoint_files.read_params(str(out_dir))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda p: Model.bind(config).forward(p, tokens, positions, jnp.ones_like(tokens), rt)[0])(params))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_gemma4_matches_transformers_and_round_trips(tmp_path, case, capsys):
    fields, feature_off = CASES[case]
    hf = make_model(fields)
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    hf.save_pretrained(hf_dir)
    keys = convert.import_hf(str(hf_dir), str(out))
    assert keys["decoder_block"] == "gemma4_text" and keys["global_head_dim"] == 32

    golden = tmp_path / "golden.npz"
    rc = check_logits.main([str(out), "--hf", str(hf_dir), "--golden", str(golden), "--length", str(LENGTH)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    print(f"gemma4_text {case}: relative logits error {last}")
    assert rc == 0 and float(last) <= 1e-5, last
    theirs = np.load(golden)["logits"]
    tokens = np.load(golden)["input_ids"]
    assert np.std(theirs) > 0.5, "logits too flat for a meaningful comparison"
    assert relative_error(ours(out, tokens, **feature_off), theirs) > 1e-3, feature_off  # the control fails
    assert relative_error(ours(out, tokens, scan=True), theirs) <= 1e-5  # the layers under lax.scan

    exported = tmp_path / "export"
    convert.export_hf(str(out), str(exported), "float32")
    original = safetensors_files.read_model_dir(str(hf_dir))
    written = safetensors_files.read_model_dir(str(exported))
    assert sorted(written) == sorted(k for k in original if k != "lm_head.weight")  # tied
    for name, array in written.items():
        assert array.tobytes() == original[name].tobytes(), name
    assert json.loads((exported / "config.json").read_text()) == {
        **json.loads((hf_dir / "config.json").read_text()), "torch_dtype": "float32", "dtype": "float32"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(hf, tokens))


def test_proportional_rope_is_transformers():
    """The global layers' frequencies: the first quarter of the pairs at the whole head's spacing, the rest 0."""
    config = transformers.Gemma4TextConfig(**{**COMMON, "global_head_dim": 64})
    theirs = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(config)
    rope = rope_lib.Rope(theta=1_000_000.0, type="proportional", proportion=0.25)
    np.testing.assert_allclose(rope_lib.inv_freq(rope, 64)[0], theirs.full_attention_inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rope_lib.inv_freq(rope_lib.Rope(theta=10_000.0), 16)[0],
                               theirs.sliding_attention_inv_freq.numpy(), rtol=1e-6)


def test_conversion_refuses_what_it_cannot_compute():
    base = {"model_type": "gemma4_text", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
            "num_hidden_layers": 6, "vocab_size": 300, "head_dim": 16, "layer_types": SIX_LAYERS}
    assert convert.model_keys(base)["global_head_dim"] == 512  # transformers' default global_head_dim
    cases = [
        ({**base, "attention_bias": True}, "attention_bias=True"),
        ({**base, "use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({**base, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 200}, "vocab_size_per_layer_input"),
        ({**base, "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 64}, "5": {"head_dim": 32}}},
         "per_layer_config"),
        ({**base, "num_kv_shared_layers": 5}, "num_kv_shared_layers=5"),
        ({**base, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "sliding_attention"),
        ({**base, "enable_moe_block": True, "num_experts": 4}, "top_k_experts"),
    ]
    for hf, message in cases:
        with pytest.raises(convert.ConversionError, match=message):
            convert.model_keys(hf)


@pytest.mark.slow
def test_multimodal_checkpoint_imports_its_text_decoder(tmp_path, capsys):
    text = transformers.Gemma4TextConfig(**{**COMMON, "hidden_size_per_layer_input": 8})
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    model = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.4 + 0.1 * torch.randn_like(p) if ("q_norm" in name or "k_norm" in name)
                    else 1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    keys = convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"), text_only=True)
    assert keys["decoder_block"] == "gemma4_text" and capsys.readouterr().out.count("text decoder") == 1
    tokens = np.random.default_rng(1).integers(0, COMMON["vocab_size"], size=(2, LENGTH)).astype(np.int32)
    assert relative_error(ours(tmp_path / "out", tokens), hf_logits(model, tokens)) <= 1e-5


@pytest.mark.slow  # ~20 s on the shared 2-core machine (73 s unjitted): three compiles of a 6-layer model
def test_decoding_with_the_cache_gives_the_forward_logits():
    """Every feature at once (two head shapes in one padded cache, shared-KV layers reading their producer's
    slots, per-layer inputs, experts): a prompt then one token at a time equals the whole sequence's forward."""
    config = config_lib.load_config([
        str(REPO / "configs" / "base.yml"), "decoder_block=gemma4_text", "base_emb_dim=32", "base_num_query_heads=4",
        "base_num_kv_heads=2", "head_dim=8", "base_mlp_dim=48", "base_num_decoder_layers=6", "vocab_size=64",
        "attention_layer_types=[sliding,full,sliding,full,sliding,full]", "sliding_window_size=3",
        "global_head_dim=16", "global_num_kv_heads=1", "attention_k_eq_v=true", "rope_type=proportional",
        "rope_proportion=0.25", "per_layer_input_dim=4", "num_kv_shared_layers=2", "double_wide_mlp=true",
        "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16", "dtype=float32", "attention=dot_product"])
    rt = Runtime.from_config(config)
    params = Model.bind(config).init_params(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 64, size=(2, 10)).astype(np.int32)
    positions = np.broadcast_to(np.arange(10, dtype=np.int32), tokens.shape)
    model = Model.bind(config)
    # jitted, as decode.py runs it: one compile for the prompt and one for every later token (index is traced)
    step = jax.jit(lambda p, t, pos, c, i: model.forward_with_cache(p, t, pos, c, i, rt))
    with jax.default_matmul_precision("highest"):
        whole = jax.jit(lambda p, t, pos: model.forward(p, t, pos, jnp.ones_like(t), rt)[0])(params, tokens, positions)
        cache = model.init_cache(2, 10, jnp.float32)
        steps, cache = step(params, tokens[:, :6], positions[:, :6], cache, jnp.int32(0))
        steps = [steps]
        for i in range(6, 10):
            out, cache = step(params, tokens[:, i:i + 1], positions[:, i:i + 1], cache, jnp.int32(i))
            steps.append(out)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, atol=1e-4, rtol=0)  # as tests/commands/test_decode.py


@pytest.mark.parametrize("overrides", [
    ["global_num_kv_heads=1"],  # kv heads of their own without keys as values
    ["attention_k_eq_v=true", "per_layer_input_dim=8", "num_kv_shared_layers=2", "double_wide_mlp=true",
     "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24", "logits_via_embedding=false"],
], ids=["global_kv_heads", "every_feature"])
def test_transformers_counts_the_exported_architecture_the_same(overrides):
    """The exported config.json builds, in transformers (on the meta device), a model of as many parameters."""
    config = config_lib.load_config([
        str(REPO / "configs" / "base.yml"), "decoder_block=gemma4_text", "base_emb_dim=64", "base_num_query_heads=4",
        "base_num_kv_heads=2", "head_dim=16", "global_head_dim=32", "base_mlp_dim=96", "base_num_decoder_layers=6",
        "vocab_size=300", "attention_layer_types=[sliding,full,sliding,full,sliding,full]", "sliding_window_size=6",
        *overrides])
    hf_config = Model.bind(config).family.to_hf_config({k: getattr(config, k) for k in model_keys.MODEL_KEYS})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
    scalars = sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    assert sum(p.numel() for p in model.parameters()) + scalars == Model.bind(config).num_params

"""Every model family against Hugging Face transformers, through the user's own commands.

For each family, a random tiny transformers model that exercises the family's particular features
(GQA with head_dim != D / N, random norm weights, a sequence longer than the sliding window, tied and
untied embeddings, RoPE scaling with a short original context, soft-caps, biases, qk-norm, experts
with a dense layer among MoE layers and unnormalized top-k router weights, attention sinks and
clamped experts, chunked attention, no-RoPE layers and attention temperature) is saved,
imported with `scripts/convert_hf.py import`, and checked with `scripts/check_logits.py --hf`
(float32, <= 1e-5 relative). A negative control changes the feature the case exercises and shows
the same comparison failing, so the test can fail. Then the import is exported, every tensor is
bitwise the original, and transformers loads the export and gives the original's logits exactly.

Needs the [hf] extra (torch, transformers); skipped with that reason without it.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckpt_helpers import REPO
from maxtrain import check_logits
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.runtime import Runtime
from maxtrain.models.families import FAMILIES
from maxtrain.checkpointing import adoption, convert, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain import config as config_lib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")

# GQA 4:2 with head_dim 24 != 64 / 4; 3 layers; 40 tokens (longer than every window below).
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=24, vocab_size=300, max_position_embeddings=64)
LENGTH = 40
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

OMITTED = object()  # a field of COMMON that the case's config class does not write

# DeepSeek-V3.2's and GLM-5's cases: MLA and experts as "deepseek-mla-groups-bias", and an indexer of 16 heads of 16
# keeping 8 keys of each query's up to 40
SPARSE_MLA = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, n_shared_experts=2, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=20,
                  qk_nope_head_dim=12, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, num_key_value_heads=4,
                  index_n_heads=16, index_head_dim=16, index_topk=8,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "mscale": 0.9, "mscale_all_dim": 0.7})

# case: (transformers class names, config fields, maxtrain keys that switch the case's feature off)
CASES = {
    "llama-llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5),
                          {"rope_type": "default"}),
    "llama-tied-linear_rope": ("LlamaConfig", "LlamaForCausalLM",
                               dict(tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
                               {"rope_factor": 1.0}),
    "llama-yarn_rope": ("LlamaConfig", "LlamaForCausalLM",
                        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 16}),
                        {"rope_type": "default"}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7), {"sliding_window_size": 0}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(), None),
    "qwen2-window_layers": ("Qwen2Config", "Qwen2ForCausalLM",
                            dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
                            {"attention_layer_types": []}),
    "qwen3-qknorm-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True), None),
    "gemma2-softcaps-window": ("Gemma2Config", "Gemma2ForCausalLM",
                               dict(sliding_window=6, query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=5.0), {"attn_logits_soft_cap": 0.0}),
    "mixtral-experts": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                        {"num_experts_per_tok": 1}),
    # MiniMax-M2: qk-norm over all heads' features, RoPE on the first 12 of each head's 24 (the released config's
    # rotary_dim), 8 experts scored by a sigmoid with a random selection bias, 3 per token; the control rotates the
    # whole head.
    "minimax_m2-qk_norm_over_heads-partial_rope-sigmoid_bias": (
        "MiniMaxM2Config", "MiniMaxM2ForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=3, rotary_dim=12, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 10000.0}),
        {"partial_rotary_factor": 1.0}),
    "qwen3_moe-mixed_layers-raw_topk": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, mlp_only_layers=[1],
             norm_topk_prob=False), {"norm_topk_prob": True}),
    # Sinks, q/k/v/o, router and expert biases, the clamped SwiGLU at a limit the activations reach and a
    # non-default alpha, alternating windows, YaRN without truncation.
    "gpt_oss-sinks-biases-clamped_experts": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.5,
             swiglu_alpha=1.3, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 16, "truncate": False}),
        {"mlp_activations_limit": 100.0}),
    "gemma3-local_global-scaled_rope": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(COMMON, num_hidden_layers=8, sliding_window=6, query_pre_attn_scalar=20, final_logit_softcapping=5.0,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
        {"local_rope_max_timescale": 100000.0}),
    # OLMo 3: post-norms only, qk-norm over all heads' features together (one scale of N*H / G*H), three
    # sliding layers per full one (5 layers: the pattern cut short), YaRN on the full layers only, an
    # unscaled RoPE of another theta on the sliding ones.
    "olmo3-postnorm-qknorm_over_heads-windows-yarn": (
        "Olmo3Config", "Olmo3ForCausalLM",
        dict(num_hidden_layers=5, sliding_window=6,
             rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 16},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
        {"sliding_window_size": 0}),
    "olmo3-tied-layer_types": (
        "Olmo3Config", "Olmo3ForCausalLM",
        dict(tie_word_embeddings=True, sliding_window=5, layer_types=["full_attention", "sliding_attention",
                                                                      "full_attention"]),
        {"local_rope_max_timescale": 10000.0}),
    # MLA (low-rank queries, v_head_dim != qk head dim, interleaved YaRN RoPE with mscale), a dense layer
    # first, shared experts, the sigmoid router over 4 groups (best 2) with a random selection bias.
    "deepseek-mla-groups-bias": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, n_shared_experts=2, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=20,
             qk_nope_head_dim=12, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, num_key_value_heads=4,
             rope_interleave=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 16, "mscale": 0.9,
                                                    "mscale_all_dim": 0.7}),
        {"rope_interleave": False}),
    # DeepSeek-V3.2: the same MLA and experts with DeepSeek Sparse Attention, each query attending to the 8 keys of
    # its 40 the lightning indexer (16 heads of 16, half-split RoPE on 8 of their features, a LayerNorm with a bias on
    # its key) scores highest; the control keeps every key. 16 heads: a score is exactly 0 only where all 16 relus
    # are, so no tie at the k-th score, where transformers' topk and ours may choose apart (indexer.py).
    "deepseek-v32_sparse_attention-indexer": (
        "DeepseekV32Config", "DeepseekV32ForCausalLM", SPARSE_MLA,
        {"index_topk": 64}),
    # GLM-5 (glm_moe_dsa): DeepSeek-V3.2's sparse attention with the indexer's RoPE on interleaved pairs; the control
    # rotates the indexer by halves (DeepSeek-V3.2's), which changes the keys it keeps.
    "deepseek-glm_moe_dsa-interleaved_indexer": (
        "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", SPARSE_MLA,
        {"index_rope_interleave": False}),
    # Chunks of 8 in the RoPE layers 0, 1, 3 (L2 qk-norm), NoPE layer 2 with attention temperature (floor scale 4,
    # so it changes within the 40 tokens), experts in layers 1 and 3 (2 of 4 per token, sigmoid weights on their
    # inputs, a shared expert), dense layers of another width, llama3 RoPE with Scout's equal frequency factors.
    "llama4_text-chunked-nope-l2norm-temperature-interleaved_moe": (
        "Llama4TextConfig", "Llama4ForCausalLM",
        dict(intermediate_size=40, intermediate_size_mlp=96, num_hidden_layers=4, num_local_experts=4,
             num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=3, attention_chunk_size=8,
             floor_scale=4, attn_scale=0.3, rope_parameters={**LLAMA3_ROPE, "high_freq_factor": 1.0}),
        {"chunk_attn_window_size": 0}),
    # Gated delta-net layers beside gated full attention (cycle 2), 2 key heads serving 4 value heads, a 3-tap
    # convolution, partial RoPE (half of each head), experts with a gated shared expert twice their width and a
    # dense layer among them.
    "qwen3_next-hybrid-gated_attention-partial_rope": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=40, mlp_only_layers=[2],
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=3,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {"partial_rotary_factor": 1.0}),
    # a shared expert that is not a whole multiple of the routed experts' width: one MLP of its own width (30 beside
    # experts of 20)
    "qwen3_next-shared_expert_of_its_own_width": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=30,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=3,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {"norm_topk_prob": False}),
    # Qwen3.5: the same stack with q, k, v in one projection and z, b, a in their own; dense, and with experts (whose
    # config class writes no intermediate_size: the MoE model has no dense MLP).
    "qwen3_5_text-hybrid-dense": (
        "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
        dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {"partial_rotary_factor": 1.0}),
    "qwen3_5_moe_text-hybrid-experts": (
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
        dict(intermediate_size=OMITTED, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=20,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=3,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {"num_experts_per_tok": 1}),
    # GLM-4.5: partial RoPE (a quarter of each head here, with YaRN over the rotated features), qk-norm, q/k/v
    # biases, a dense layer first, two shared experts beside the sigmoid router over 4 groups (best 2) with a
    # random selection bias, scaled weights.
    "glm4_moe-partial_yarn_rope-qknorm-biases-groups": (
        "Glm4MoeConfig", "Glm4MoeForCausalLM",
        dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, n_shared_experts=2, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16, "partial_rotary_factor": 0.25},
             num_nextn_predict_layers=0),
        {"partial_rotary_factor": 1.0}),
    # GLM-4.5-Air's choices: no qk-norm, biases, one group, transformers' default half-head RoPE (config.json's
    # rope_parameters carry it), two dense layers first, unnormalized top-k weights; the MTP field left at 1.
    "glm4_moe-air-dense_first-raw_topk": (
        "Glm4MoeConfig", "Glm4MoeForCausalLM",
        dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
             first_k_dense_replace=2, attention_bias=True, norm_topk_prob=False, routed_scaling_factor=1.5),
        {"norm_topk_prob": True}),
}


def make_hf_model(config_class: str, model_class: str, fields: dict, seed: int = 0):
    config = getattr(transformers, config_class)(**{k: v for k, v in {**COMMON, **fields}.items() if v is not OMITTED})
    model = getattr(transformers, model_class)(config).eval()
    torch.manual_seed(seed)
    plus_one = any(n in model_class for n in ("Gemma", "Qwen3Next", "Qwen3_5"))  # norm scales stored as (scale - 1)
    with torch.no_grad():  # random everything, norms included, at a scale that gives lively logits
        for name, p in model.named_parameters():
            p.copy_((0.0 if plus_one else 1.0) + 0.3 * torch.randn_like(p) if "norm" in name
                    else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's selection bias: a buffer, saved with the weights
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def ids(vocab: int, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, size=(rows, LENGTH)).astype(np.int32)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def relative_error(ours, theirs) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def ours_with(out_dir, tokens, **changes) -> np.ndarray:
    """maxtrain's float32 logits for the imported checkpoint, with model settings changed."""
    config = adoption.adopt_model_settings(config_lib.load_config(
        [str(REPO / "configs" / "base.yml"), f"load_parameters_path={out_dir}", "attention=dot_product",
         "dtype=float32"]), log=lambda *a: None)
    config = config.replace(**changes)
    rt = Runtime.from_config(config)
    params = checkpoint_files.read_params(str(out_dir))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda p: Model.bind(config).forward(p, tokens, positions, jnp.ones_like(tokens), rt)[0])(params))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers_and_round_trips(tmp_path, case, capsys):
    config_class, model_class, fields, feature_off = CASES[case]
    hf = make_hf_model(config_class, model_class, fields)
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    sharded = case.startswith("llama-tied")
    hf.save_pretrained(hf_dir, max_shard_size="50KB" if sharded else "1GB")
    keys = convert.import_hf(str(hf_dir), str(out))
    assert keys["decoder_block"] == case.split("-")[0]
    assert (out / "model.yml").is_file() and (out / "hf" / "config.json").is_file()

    # The user command: golden logits from transformers, maxtrain's compared at <= 1e-5.
    golden = tmp_path / "golden.npz"
    rc = check_logits.main([str(out), "--hf", str(hf_dir), "--golden", str(golden), "--length", str(LENGTH)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    print(f"{case}: relative logits error {last}")
    assert rc == 0 and float(last) <= 1e-5, last
    theirs = np.load(golden)["logits"]
    assert np.std(theirs) > 0.5, "logits too flat for a meaningful comparison"
    assert check_logits.main([str(out), "--golden", str(golden)]) == 0  # the same from the file

    # Negative control: without the feature this case exercises, the comparison fails.
    tokens = np.load(golden)["input_ids"]
    if feature_off is not None:
        assert relative_error(ours_with(out, tokens, **feature_off), theirs) > 1e-3, feature_off
    else:  # biases / qk-norm exist as parameters: zero the biases, or use unit qk-norm scales
        params = checkpoint_files.read_params(str(out))
        layer = params["layers"]["decoder"]
        assert "bq" in layer or "q_norm" in layer
        name = "bq" if "bq" in layer else "q_norm"
        changed = {**layer, name: np.zeros_like(layer[name]) if name == "bq" else np.ones_like(layer[name])}
        broken = checkpoint_tree_with(out, tmp_path / "broken", {**params, "layers": {"decoder": changed}})
        assert check_logits.main([str(broken), "--golden", str(golden)]) == 1

    # Export: every tensor bitwise the original; transformers loads it and gives the same logits.
    exported = tmp_path / "export"
    convert.export_hf(str(out), str(exported), "float32", max_shard_bytes=64 * 1024 if sharded else 2**30)
    assert (exported / "model.safetensors.index.json").exists() == sharded
    # The tensors as saved (transformers 5 fuses each layer's experts in memory, but saves them one per expert).
    original = safetensors_files.read_model_dir(str(hf_dir))
    written = safetensors_files.read_model_dir(str(exported))
    assert sorted(written) == sorted(k for k in original if not (k == "lm_head.weight" and keys["logits_via_embedding"]))
    for name, array in written.items():
        assert array.tobytes() == original[name].tobytes(), name
    assert json.loads((exported / "config.json").read_text()) == {
        **json.loads((hf_dir / "config.json").read_text()), "torch_dtype": "float32", "dtype": "float32"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(hf, tokens))


def checkpoint_tree_with(out, dest, params) -> str:
    """A params-only checkpoint like `out`'s (same metadata) holding `params`."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    meta = checkpoint_files.read_metadata(checkpoint_files.find_step_dir(str(out)))
    with ocp.CheckpointManager(str(dest / "checkpoints"), item_handlers={
            "state": ocp.StandardCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()}) as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params}),
                                                metadata=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    return str(dest)


def _rewrite_config(hf_dir, **changes):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("conflict", ["rope_scaling_and_rope_parameters", "rope_theta_twice", "legacy_rope_theta"])
def test_a_config_that_states_rope_twice_reads_as_transformers_reads_it(tmp_path, conflict, capsys):
    """Today's transformers: rope_scaling replaces rope_parameters, and rope_parameters.rope_theta wins over
    a top-level rope_theta. The import must compute the model transformers computes, and say what it ignored."""
    hf_dir = tmp_path / "hf"
    make_hf_model("LlamaConfig", "LlamaForCausalLM", {}).save_pretrained(hf_dir)
    if conflict == "rope_scaling_and_rope_parameters":
        _rewrite_config(hf_dir, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    elif conflict == "rope_theta_twice":
        _rewrite_config(hf_dir, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    else:  # the older form: rope_theta at the top level, no rope_parameters
        cfg = json.loads((hf_dir / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=500.0, rope_scaling=None)
        (hf_dir / "config.json").write_text(json.dumps(cfg))
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    keys = convert.import_hf(str(hf_dir), str(tmp_path / "out"))
    printed = capsys.readouterr().out
    if conflict != "legacy_rope_theta":
        assert "states" in printed and "ignored" in printed, printed
    tokens = ids(COMMON["vocab_size"])
    rel = relative_error(ours_with(tmp_path / "out", tokens), hf_logits(reference, tokens))
    assert rel <= 1e-5, (keys["rope_type"], keys["rope_max_timescale"], rel)


@pytest.mark.slow
def test_gemma3_multimodal_checkpoint_imports_its_text_decoder(tmp_path, capsys):
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=16)
    text = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6, "sliding_window": 6,
                                            "query_pre_attn_scalar": 24})
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    keys = convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert keys["decoder_block"] == "gemma3" and "text decoder" in capsys.readouterr().out
    tokens = ids(COMMON["vocab_size"])
    rel = relative_error(ours_with(tmp_path / "out", tokens), hf_logits(model, tokens))
    assert rel <= 1e-5, rel


@pytest.mark.slow
def test_qwen3_5_multimodal_checkpoint_imports_its_language_model(tmp_path, capsys):
    """Qwen3.5's released checkpoints are vision-language models: the text-only import reads the language model's
    weights (model.language_model.*), says it left the vision tower out, and gives the text model's logits."""
    arch, _, kwargs, _ = CASES["qwen3_5_text-hybrid-dense"]
    text = getattr(transformers, arch)(**{**COMMON, **kwargs})
    vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=COMMON["hidden_size"], num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    keys = convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"), text_only=True)  # else: qwen3_5, the tower
    printed = capsys.readouterr().out
    assert keys["decoder_block"] == "qwen3_5_text" and "text decoder" in printed and "left out" in printed, printed
    tokens = ids(COMMON["vocab_size"])
    rel = relative_error(ours_with(tmp_path / "out", tokens), hf_logits(model, tokens))
    assert rel <= 1e-4, rel


@pytest.mark.slow
def test_kimi_k2_config_imports_as_deepseek(tmp_path):
    """Kimi K2's config.json says model_type "kimi_k2" (DeepSeek-V3's architecture; transformers reads it only with
    remote code): the deepseek family imports it, with one routing group and 2.827's scaling as Kimi K2 has, and
    its logits are those of transformers' DeepseekV3ForCausalLM on the same weights."""
    fields = {**CASES["deepseek-mla-groups-bias"][2], "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "beta_fast": 1.0,
                                  "beta_slow": 1.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                                  "mscale_all_dim": 1.0}}
    model = make_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", fields)
    model.save_pretrained(tmp_path / "hf")
    _rewrite_config(tmp_path / "hf", model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    keys = convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert keys["decoder_block"] == "deepseek" and keys["n_routing_groups"] == -1  # one group: no group limit
    assert keys["routed_scaling_factor"] == 2.827
    tokens = ids(COMMON["vocab_size"])
    rel = relative_error(ours_with(tmp_path / "out", tokens), hf_logits(model, tokens))
    assert rel <= 1e-5, rel


def test_conversion_errors_name_the_field(tmp_path):
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
            "num_hidden_layers": 2, "vocab_size": 300}
    cases = [
        ({**base, "model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        ({**base, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({**base, "attention_bias": True}, "attention_bias=True"),
        ({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not implemented"),
        ({k: v for k, v in base.items() if k != "hidden_size"}, "no 'hidden_size'"),
        ({**base, "model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**base, "model_type": "mistral", "layer_types": ["full_attention"] * 2}, "Ministral"),
        ({**base, "model_type": "olmo3", "attention_bias": True}, "attention_bias=True"),
        ({**base, "model_type": "olmo3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
         "not split by layer type"),
    ]
    for hf, message in cases:
        with pytest.raises(convert.ConversionError, match=message):
            convert.model_keys(hf)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(convert.ConversionError, match="cannot read .*config.json"):
        convert.read_hf_config(str(tmp_path))


def test_hf_fields_used_as_sizes_divisors_or_steps_are_range_checked():
    """A field maxtrain divides by or steps with, set to an invalid 0 (or -1), is named; never read as its default."""
    llama4 = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 96,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 300,
              "num_local_experts": 4, "num_experts_per_tok": 1}
    qwen = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 300, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    deepseek = {**qwen, "model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 8,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 10, "kv_lora_rank": 16}
    for hf, field, value in ((llama4, "no_rope_layer_interval", 0), (llama4, "interleave_moe_layer_step", 0),
                             (qwen, "decoder_sparse_step", 0), (qwen, "num_key_value_heads", 0), (qwen, "head_dim", 0),
                             (deepseek, "n_group", 0), (deepseek, "first_k_dense_replace", -1)):
        with pytest.raises(convert.ConversionError, match=f"config.json: {field}={value} must be an integer >= "):
            convert.model_keys({**hf, field: value})
    assert convert.model_keys({**qwen, "decoder_sparse_step": None})["decoder_sparse_step"] == 1  # null: the default
    assert convert.model_keys({**deepseek, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0,
                               "q_lora_rank": None})["first_num_dense_layers"] == 0


def test_glm5_layer_patterns_import_or_are_refused_naming_the_field():
    """GLM-5's config.json: indexer layers that reuse the previous layer's top-k ("shared") import, from the list or
    from index_topk_pattern / index_topk_freq as transformers derives them; a first layer "shared" (nothing before it
    to reuse), or dense and MoE layers in another order than the first first_k_dense_replace dense, are refused naming
    the field. Every indexer "full" imports as indexer_types [], with the indexer's RoPE interleaved and one group."""
    glm = {"model_type": "glm_moe_dsa", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 300, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
           "v_head_dim": 10, "kv_lora_rank": 16, "q_lora_rank": 24, "first_k_dense_replace": 1,
           "index_n_heads": 4, "index_head_dim": 8, "index_topk": 16}
    keys = convert.model_keys({**glm, "indexer_types": ["full"] * 4, "mlp_layer_types": ["dense"] + ["sparse"] * 3})
    assert keys["index_rope_interleave"] is True and keys["n_routing_groups"] == -1 and keys["index_n_heads"] == 4
    assert keys["indexer_types"] == []
    alternate = ["full", "shared", "full", "shared"]
    assert convert.model_keys({**glm, "indexer_types": alternate})["indexer_types"] == alternate
    assert convert.model_keys({**glm, "index_topk_pattern": "FSFS"})["indexer_types"] == alternate
    freq = {**glm, "index_topk_freq": 2, "index_skip_topk_offset": 1}
    assert convert.model_keys(freq)["indexer_types"] == transformers.GlmMoeDsaConfig(**freq).indexer_types == alternate
    with pytest.raises(convert.ConversionError, match=r"indexer_types starts with \"shared\": .*make it \"full\"$"):
        convert.model_keys({**glm, "indexer_types": ["shared", "full", "full", "shared"]})
    with pytest.raises(convert.ConversionError, match=r"mlp_layer_types is not the first first_k_dense_replace=1 "):
        convert.model_keys({**glm, "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]})


def test_olmo3_reads_rope_theta_as_transformers_does_and_export_keeps_sliding_rope_unscaled():
    """A top-level rope_theta sets only the full layers' RoPE (transformers' Olmo3Config); the sliding layers'
    stays 500,000, and the import says so. An export whose sliding layers would inherit the global scaling
    (local_rope_max_timescale=-1 with YaRN) is refused, naming the key."""
    olmo3 = FAMILIES["olmo3"]
    hf_config = {"model_type": "olmo3", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
                 "num_hidden_layers": 4, "vocab_size": 300, "rope_theta": 1000.0}
    notes = []
    keys = olmo3.from_hf_config(hf_config, notes)
    assert (keys["rope_max_timescale"], keys["local_rope_max_timescale"]) == (1000.0, 500000.0)
    assert keys["sliding_window_size"] == 4096 and keys["attention_layer_types"] == []  # transformers' defaults
    assert any("only the full-attention layers" in n for n in notes), notes
    assert transformers.Olmo3Config(num_hidden_layers=4, rope_theta=1000.0).rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
    model = {k: getattr(config_lib.load_config([str(REPO / "configs" / "base.yml"), "model_name=olmo3-7b"]), k)
             for k in model_keys.MODEL_KEYS}
    with pytest.raises(convert.ConversionError, match="local_rope_max_timescale=-1.0"):
        olmo3.to_hf_config({**model, "local_rope_max_timescale": -1.0})


def test_qk_norm_over_heads_normalizes_all_heads_features_together():
    """q_norm [N, H] (OLMo 2/3) is torch's RMSNorm over the flattened N * H features, not one per head."""
    from maxtrain.models import blocks  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    q, scale = rng.normal(size=(2, 5, 4, 6)).astype(np.float32), rng.normal(size=(4, 6)).astype(np.float32)
    norm = torch.nn.RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(scale.reshape(24)))
        theirs = norm(torch.from_numpy(q.reshape(2, 5, 24))).numpy().reshape(q.shape)
    np.testing.assert_allclose(np.asarray(blocks.rms_norm(jnp.asarray(q), jnp.asarray(scale), 1e-6)), theirs,
                               rtol=1e-5, atol=1e-6)
    per_head = q / np.sqrt(np.mean(q**2, axis=-1, keepdims=True) + 1e-6) * scale  # each head normed alone
    assert np.max(np.abs(per_head - theirs)) > 1e-2

"""Presets at real sizes, and each family's FLOPs formula against XLA's own count.

Parameter counts: the published figures (model cards and the safetensors totals of the released
checkpoints), and where transformers is installed, the count transformers itself gives for the same
architecture (built on the meta device from the family's exported config.json: nothing is allocated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.models import attention
from maxtrain.training import builder
from maxtrain import config as config_lib
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.families import FAMILIES
from maxtrain.models.families.deepseek import selected
from maxtrain.observability import metrics
from maxtrain.config import features, load_config, with_overrides
from maxtrain.models import blocks

# Published parameter counts (exact totals of the released checkpoints; Gemma 3 4B: its text decoder,
# the published 4.3B including the vision encoder).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,      # model card: 0.6B, 0.44B without the embedding
    "qwen3-8b": 8_190_735_360,      # model card: 8.2B, 6.95B without the embeddings
    "gemma2-2b": 2_614_341_888,
    "gemma2-9b": 9_241_705_984,
    "gemma3-1b": 999_885_952,
    "gemma3-4b": 3_880_263_168,
    "mixtral-8x7b": 46_702_792_704,  # 12.88B active per token (tests/models/test_moe.py)
    "qwen3-30b-a3b": 30_532_122_624,  # 3.35B active per token (tests/models/test_moe.py)
    "gpt-oss-20b": 20_914_757_184,   # model card: 20.9B, 3.6B active (below)
    "gpt-oss-120b": 116_829_156_672,  # model card: 116.8B, 5.1B active
    "olmo3-7b": 7_298_011_136,       # transformers' count of Olmo-3-1025-7B's config (the model card: 7B)
    "olmo3-32b": 32_233_522_176,     # transformers' count of OLMo 3 32B's config (the model card: 32B)
    "deepseek3-671b": 671_026_419_200,  # 671B, 37B active (below); the released 685B adds the MTP module
    "deepseek3-tiny": 8_166_320,     # DeepSeek-V3's architecture at the default model's sizes (not released)
    # DeepSeek-V3.2: transformers' DeepseekV32ForCausalLM counts 671,877,929,216 parameters and keeps the 58 MoE
    # layers' 256 selection biases (14,848) as buffers
    "deepseek3.2-671b": 671_877_944_064,
    "deepseek3.2-tiny": 8_252_592,   # deepseek3-tiny with a lightning indexer of 4 heads of 32
    # Kimi K2: transformers' DeepseekV3ForCausalLM of its config counts 1,026,408,209,408 and keeps the 60 MoE layers'
    # 384 selection biases (23,040) as buffers; its model card: 1T total, 32B activated (below)
    "kimi-k2-1t": 1_026_408_232_448,
    # MiniMax-M2: transformers' MiniMaxM2ForCausalLM of its default config with the released rotary_dim counts
    # 228,689,748,992 and keeps the 62 layers' 256 selection biases (15,872) as buffers; model card: 230B, 10B active
    "minimax-m2": 228_689_764_864,
    # GLM-5: transformers' GlmMoeDsaForCausalLM of its default config (the released one) counts 743,911,199,232 and keeps
    # the 75 MoE layers' 256 selection biases (19,200) as buffers; the model card: 744B, 40B active (below)
    "glm-5": 743_911_218_432,
    "gemma4-default": 5_077_177_886,  # transformers' default Gemma4TextConfig (no model card gives a text config)
    "glm-4.5-air": 106_852_251_264,  # transformers' count; model card: 106B, 12B active (below), without the MTP layer
    "glm-4.5": 352_797_829_024,      # transformers' count, without the MTP layer; model card: 355B, 32B active
    # Llama 4's text decoders: transformers' count of the same architecture (the published 109B and 400B
    # totals, 17B active, include the vision encoder)
    "llama4-scout": 107_769_861_120,
    "llama4-maverick": 400_711_848_960,
    "qwen3-next-80b-a3b": 79_674_391_296,  # model card: 80B total, 3B activated (3.56B here without the embedding)
    # Qwen3.5's text decoders: transformers' count of the same architecture (the released checkpoints are
    # multimodal: their 27B, 35B, 122B and 397B include the vision tower); active per token below
    "qwen3.5-27b": 26_895_998_464,
    "qwen3.5-35b-a3b": 34_660_610_688,
    "qwen3.5-122b-a10b": 122_111_526_912,
    "qwen3.5-397b-a17b": 396_346_350_336,
    # The image-text models with their towers: transformers' count of the ConditionalGeneration class (Qwen3.5-35B-A3B
    # with transformers' default Qwen3_5MoeVisionConfig; Gemma 4 at its default Gemma4Config with a vision tower)
    "qwen3.5-35b-a3b-vl": 35_107_181_936,
    "gemma4-default-vl": 5_246_311_966,
    # DeepSeek-V4-Flash: transformers' DeepseekV4ForCausalLM of its default config (documented as V4-Flash-Base)
    # counts 284,325,869,015 and keeps the 40 top-k layers' 256 selection biases (10,240) and the 3 hash layers'
    # token -> experts tables (2,327,040) as buffers; 284B total, 13B active (below)
    "deepseek4-flash": 284_328_206_295,
    "deepseek4-tiny": 2_271_653,     # DeepSeek-V4's architecture at a laptop's size (not released)
    "gpt2-small": 123_587_328,      # GPT-2 small's shape as a Llama (124M with GPT-2's own layers)
    "default": 5_507_328,
}
# The rounded figures the model cards state, checked as well.
MODEL_CARD = {"qwen3-0.6b": (0.6e9, 0.44e9), "qwen3-8b": (8.2e9, 6.95e9)}
# gpt-oss's model card: active parameters per token, counted without the input embedding table.
ACTIVE_WITHOUT_EMBEDDING = {"gpt-oss-20b": 3.6e9, "gpt-oss-120b": 5.1e9}
# DeepSeek-V3's paper: 37B activated per token (counted, like gpt-oss's, without the input embedding table).
ACTIVE_BILLIONS_WITHOUT_EMBEDDING = {"deepseek3-671b": 37, "kimi-k2-1t": 32, "deepseek4-flash": 13}
# GLM-4.5's model card: 12B (Air) and 32B active, counted without the embedding table and the output head.
ACTIVE_BILLIONS_WITHOUT_EMBEDDING_AND_HEAD = {"glm-4.5-air": 12, "glm-4.5": 32, "glm-5": 40, "minimax-m2": 10}
# Qwen3.5's names: A3B, A10B, A17B activated per token (3.45B, 9.77B and 17.35B counted with the embeddings).
ACTIVE_BILLIONS = {"qwen3.5-35b-a3b": 3, "qwen3.5-122b-a10b": 10, "qwen3.5-397b-a17b": 17}


def preset(name, *overrides):
    return load_config([BASE_YML, f"model_name={name}", *overrides])


def test_every_preset_is_checked():
    assert set(config_lib.preset_names()) - {"llama3-1b"} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_is_the_published_one(name):
    cfg = preset(name)
    assert Model.bind(cfg).num_params == PUBLISHED[name]
    if name in MODEL_CARD:
        total, non_embedding = MODEL_CARD[name]
        embeddings = cfg.vocab_size * cfg.base_emb_dim * (1 if cfg.logits_via_embedding else 2)
        assert round(Model.bind(cfg).num_params / 1e8) == round(total / 1e8)
        assert round((Model.bind(cfg).num_params - embeddings) / 1e7) == round(non_embedding / 1e7)
    if name in ACTIVE_WITHOUT_EMBEDDING:
        assert round(Model.bind(cfg).num_params / 1e8) == round(PUBLISHED[name] / 1e8)
        active = Model.bind(cfg).num_active_params - cfg.vocab_size * cfg.base_emb_dim
        assert round(active / 1e8) == round(ACTIVE_WITHOUT_EMBEDDING[name] / 1e8)
    if name in ACTIVE_BILLIONS_WITHOUT_EMBEDDING:
        active = Model.bind(cfg).num_active_params - cfg.vocab_size * cfg.base_emb_dim
        assert round(active / 1e9) == ACTIVE_BILLIONS_WITHOUT_EMBEDDING[name]
    if name in ACTIVE_BILLIONS_WITHOUT_EMBEDDING_AND_HEAD:
        active = Model.bind(cfg).num_active_params - 2 * cfg.vocab_size * cfg.base_emb_dim
        assert round(active / 1e9) == ACTIVE_BILLIONS_WITHOUT_EMBEDDING_AND_HEAD[name]
    if name in ACTIVE_BILLIONS:
        assert round(Model.bind(cfg).num_active_params / 1e9) == ACTIVE_BILLIONS[name]


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - {"default", "gpt2-small"}))
def test_transformers_counts_the_same_architecture_the_same(name):
    torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    cfg = preset(name)
    keys = {k: getattr(cfg, k) for k in model_keys.MODEL_KEYS}
    hf_config = Model.bind(cfg).family.to_hf_config(keys)
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):  # an image-text preset (with its tower): the ConditionalGeneration class
        model = (getattr(transformers, Model.bind(cfg).family.row.hf_architecture)(config) if cfg.vision_config
                 else transformers.AutoModelForCausalLM.from_config(config))
    # DeepSeek's selection bias, DeepSeek-V4's hash tables and Gemma 4's layer scalars are buffers in
    # transformers, tensors of the checkpoint all the same
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias", "layer_scalar", "tid2eid")))
    assert sum(p.numel() for p in model.parameters()) + bias == Model.bind(cfg).num_params


# Small unrolled models per family: XLA's cost analysis counts a scanned body once, and dense
# dot_product attention computes the whole T x T score matrix (so the formula counts every key).
FLOPS_MODEL = ["base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=32", "base_mlp_dim=384",
               "base_num_decoder_layers=4", "vocab_size=512", "max_target_length=64", "per_device_batch_size=4",
               "scan_layers=false", "remat_policy=none", "dtype=float32", "attention=dot_product",
               "ici_fsdp_parallelism=1"]
WINDOW = ["sliding_window_size=16"]  # the families whose layers slide (a window is refused where none does)
# Mixtures of experts with experts to route among; capacity dispatch at factor 1 computes exactly the active
# experts' FLOPs (XLA:CPU computes dropless's grouped matmul densely, over every expert; docs/moe.md). AdamW
# and the gradient sums run over every expert, twice the active parameters here: 4x the tokens keeps that
# elementwise work as small a share of the step as in the dense models.
MOE_FLOPS = ["num_experts=4", "num_experts_per_tok=2", "moe_dispatch=capacity", "capacity_factor=1.0",
             "per_device_batch_size=16"]
HYBRID_FLOPS = ["inhomogeneous_layer_cycle_interval=2", "gdn_num_key_heads=2", "gdn_num_value_heads=4",
                "gdn_key_head_dim=32", "gdn_value_head_dim=32", "gdn_chunk_size=16", "partial_rotary_factor=0.25"]
FAMILY_FLOPS = {"mixtral": MOE_FLOPS, "qwen3_moe": [*MOE_FLOPS, "mlp_only_layers=[1]", "base_moe_mlp_dim=192"],
                "gpt_oss": MOE_FLOPS,
                # MLA (q/k 24 + 8 features, values 40), a dense first layer, one shared expert, one MTP module
                "deepseek": [*MOE_FLOPS, "base_num_kv_heads=4", "q_lora_rank=48", "kv_lora_rank=32",
                             "qk_nope_head_dim=24", "qk_rope_head_dim=8", "v_head_dim=40", "first_num_dense_layers=1",
                             "shared_experts=1", "base_moe_mlp_dim=96", "routed_bias=true", "mtp_num_layers=1"],
                # chunks of 16 in the RoPE layers, NoPE layers 1 and 3, experts in layers 1 and 3 with a shared one
                "llama4_text": [*MOE_FLOPS, "decoder_sparse_step=2", "nope_layer_interval=2",
                                "chunk_attn_window_size=16", "shared_experts=1", "base_moe_mlp_dim=192",
                                "use_qk_norm=true", "temperature_tuning=true"],
                # gated delta-net and full attention alternating, 2 key heads serving 4 value heads, partial RoPE
                "qwen3_next": [*MOE_FLOPS, "shared_experts=1", "base_moe_mlp_dim=96", *HYBRID_FLOPS],
                "qwen3_5_text": HYBRID_FLOPS,  # the same stack with a gated MLP in every layer
                "qwen3_5_moe_text": [*MOE_FLOPS, "shared_experts=1", "base_moe_mlp_dim=96", *HYBRID_FLOPS],
                # half-head RoPE, qk-norm, q/k/v biases, a dense first layer, one shared expert, one MTP module
                "glm4_moe": [*MOE_FLOPS, "partial_rotary_factor=0.5", "use_qk_norm=true", "attention_bias=true",
                             "first_num_dense_layers=1", "shared_experts=1", "base_moe_mlp_dim=96", "routed_bias=true",
                             "mtp_num_layers=1"],
                # DeepSeek-V4: its default schedule (HCA, HCA, HCA, CSA), 2 streams, one hash-routed layer; its
                # experts through the shared block with capacity dispatch, as the other MoE families here
                "deepseek_v4": ["num_experts=2", "num_experts_per_tok=2", "base_moe_mlp_dim=96", "q_lora_rank=32",
                                "moe_dispatch=capacity", "capacity_factor=1.0",
                                "index_n_heads=2", "index_head_dim=32", "index_topk=4", "o_groups=2",
                                "o_lora_rank=32", "hc_mult=2", "hc_sinkhorn_iters=3", "compress_rate_hca=8",
                                "num_hash_layers=1", "partial_rotary_factor=0.5",
                                "max_new_tokens=0", "per_device_batch_size=16"],
                # qk-norm over all heads, half-head RoPE, a selection bias
                "minimax_m2": [*MOE_FLOPS, "partial_rotary_factor=0.5", "routed_bias=true"],
                # full-attention layers of their own head shape with keys as values, per-layer inputs, two
                # shared-KV layers with double-wide MLPs, experts beside every dense MLP
                "gemma4_text": [*MOE_FLOPS, "attention_layer_types=[sliding,full,sliding,full]", "global_head_dim=64",
                                "global_num_kv_heads=1", "attention_k_eq_v=true", "per_layer_input_dim=16",
                                "num_kv_shared_layers=2", "double_wide_mlp=true", "base_moe_mlp_dim=96",
                                "rope_type=proportional", "rope_proportion=0.25"]}
FAMILY_FLOPS["llama4"] = FAMILY_FLOPS["llama4_text"]  # the same decoder (without vision_config: no tower)
FAMILY_FLOPS["gemma4"] = FAMILY_FLOPS["gemma4_text"]  # without a vision_config: the same text decoder
FAMILY_FLOPS["qwen3_5"] = FAMILY_FLOPS["qwen3_5_text"]  # the image families: their text decoders (no vision_config)
FAMILY_FLOPS["qwen3_5_moe"] = FAMILY_FLOPS["qwen3_5_moe_text"]


# The families whose 4-layer schedule is the point (DeepSeek-V4's HCA x 3 + CSA, gemma4's layer types and shared-KV
# layers, gemma3's and olmo3's local/global periods); every other family shows each of its layer kinds in 2 layers
# (a dense first layer and an MoE one, one of each hybrid kind), which halves the unrolled program XLA compiles.
FOUR_LAYERS = {"deepseek_v4", "gemma4_text", "gemma4", "gemma3", "olmo3"}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_formula_matches_xla_count(family):
    """Within 5%: XLA also counts the elementwise work the formula leaves out (norms, softmax,
    activations, soft-caps, AdamW)."""
    window = WINDOW if family in features.SLIDING_FAMILIES else []
    layers = [] if family in FOUR_LAYERS else ["base_num_decoder_layers=2"]
    cfg = load_config(with_overrides([BASE_YML, *FLOPS_MODEL, *window], f"decoder_block={family}",
                                     *FAMILY_FLOPS.get(family, []), *layers))
    run = builder.build(cfg, devices=jax.devices()[:1])
    cost = run.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    formula = metrics.flops_per_token(Model.bind(run.config), dense_attention=True) * run.config.tokens_per_step
    print(f"{family}: XLA {cost['flops']:.4g} FLOPs, formula {formula:.4g} ({cost['flops'] / formula - 1:+.1%})")
    assert cost["flops"] == pytest.approx(formula, rel=0.05)


@pytest.mark.slow
def test_flops_formula_counts_the_kept_keys_of_sparse_attention_as_xla_does(monkeypatch):
    """DeepSeek Sparse Attention keeping 32 of 512 keys (models/families/deepseek/selected.py, in one block of queries
    here: XLA's cost analysis counts a loop's body once): within 5% of XLA's count, where counting every key, as
    MLA without the indexer computes, is not (the control)."""
    monkeypatch.setattr(selected, "QUERY_BLOCK", 512)
    mine = {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 32, "max_target_length": 512,
            "per_device_batch_size": 2, "mtp_num_layers": 0}  # (no MTP with the indexer yet)
    model, family = ([o for o in overrides if o.split("=")[0] not in mine]
                     for overrides in (FLOPS_MODEL, FAMILY_FLOPS["deepseek"]))
    cfg = load_config(with_overrides([BASE_YML, *model], "decoder_block=deepseek", *family,
                                     *(f"{k}={v}" for k, v in mine.items())))
    run = builder.build(cfg, devices=jax.devices()[:1])
    assert "index_topk=32 of 512 keys per query" in run.rt.attention_reason  # the selected form, not the mask
    cost = run.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    tokens = run.config.tokens_per_step
    formula = metrics.flops_per_token(Model.bind(run.config), dense_attention=True) * tokens
    every_key = metrics.flops_per_token(Model.bind(run.config.replace(index_topk=512)), dense_attention=True) * tokens
    print(f"XLA {cost['flops']:.4g} FLOPs, formula {formula:.4g} ({cost['flops'] / formula - 1:+.1%}), every key "
          f"{every_key:.4g} ({cost['flops'] / every_key - 1:+.1%})")
    assert cost["flops"] == pytest.approx(formula, rel=0.05)
    assert cost["flops"] != pytest.approx(every_key, rel=0.05)


@pytest.mark.parametrize("length, window", [(64, 0), (64, 16), (64, 64), (64, 100), (7, 3)])
def test_attended_keys_count_the_mask(length, window):
    """The FLOPs formula's keys per query equal the true entries of the attention mask the model uses."""
    seg = jnp.ones((1, length), jnp.int32)
    mask = attention.make_attention_mask(seg, seg, causal=True, sliding_window=window)
    assert blocks.attended_keys(length, window) * length == pytest.approx(float(np.sum(mask)))


def test_sliding_windows_count_only_the_keys_attended():
    full = preset("gemma3-1b", "max_target_length=8192", "sliding_window_size=8192")
    windowed = preset("gemma3-1b", "max_target_length=8192")  # 512-token windows in 5 of 6 layers
    saved = metrics.flops_per_token(Model.bind(full)) - metrics.flops_per_token(Model.bind(windowed))
    sliding_layers = sum(t.attention == "sliding" for t in Model.bind(windowed).layer_types)
    per_key = 3 * 2 * 2 * windowed.base_num_query_heads * windowed.head_dim
    expected = sliding_layers * per_key * (blocks.attended_keys(8192) - blocks.attended_keys(8192, 512))
    assert sliding_layers == 22 and saved == pytest.approx(expected)

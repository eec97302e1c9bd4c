"""DeepSeek-V3 (DeepSeek-AI 2024; R1 shares its architecture): multi-head latent attention, and a mixture of
experts with shared experts, a sigmoid group-limited router and aux-loss-free balancing.

    x = x + mla(rmsnorm(x))          low-rank queries and keys/values, one RoPE key for all heads (models/families/deepseek/mla.py)
    x = x + moe(rmsnorm(x))          layers i >= first_num_dense_layers:
                                     s = sigmoid(router logits); experts chosen by s + bias among the
                                     topk_routing_group best of n_routing_groups groups; weights s of the
                                     chosen, normalized, x routed_scaling_factor; plus shared_experts
                                     always-on experts (models/moe/)
    x = x + swiglu_mlp(rmsnorm(x))   the first first_num_dense_layers layers: a dense MLP of base_mlp_dim

The selection bias (`router_bias`, Hugging Face's e_score_correction_bias) is a parameter the optimizer
never changes; with routed_bias_update_rate > 0 the train step moves it after each step by the sign rule
(sigmoid_groups.update_router_bias). Two layer kinds, "dense" then "moe", as qwen3_moe's.

Multi-token prediction (mtp_num_layers; Hugging Face's num_nextn_predict_layers): models/mtp.py, its modules'
blocks of the "moe" kind; their weights are params["mtp"], the layers after num_hidden_layers in a Hugging Face
checkpoint (read by an import with keep_mtp, never written by an export: transformers has no MTP).

DeepSeek-V3.2 (index_n_heads > 0; Hugging Face's deepseek_v32): DeepSeek Sparse Attention, a lightning indexer in
front of MLA that keeps the index_topk keys each query attends to (indexer.py). Where a sequence (or the decoding
cache) holds no more than index_topk tokens every query keeps every key it sees, and the indexer is skipped (MLA
runs its kernels); beyond, each query reads its chosen keys alone (selected.py: MLA's absorbed form, by the selected-key Pallas kernel,
kernels/selected_attention.py, or _tpu.py on TPUs, where attention resolves to flash: autoselected on GPUs and TPUs,
or set; in plain jnp by query blocks otherwise; kernel_choice.choose_selected says why in the summary; W_kvb runs unquantized there under
quantization=fp8). Decoding caches each token's indexer key beside MLA's latent
(layer_cache). The language-model loss does not train the indexer; indexer_training does, towards the attention's
distribution with a KL loss, in DeepSeek's dense warm-up or sparse stage (indexer_training.py). Under context
parallelism (context_parallel_strategy=all_gather) each device chooses and attends for its own queries against the
gathered latents and indexer keys (selected_context.py); ring, ulysses and usp are refused. V3.2's config.json has
no rope_interleave: its MLA always interleaves, its indexer rotates by halves.

GLM-5 (Hugging Face's glm_moe_dsa) is DeepSeek-V3.2's architecture with the indexer's RoPE on interleaved pairs
(index_rope_interleave) and one routing group; its config's "shared" indexer layers (indexer_types) run no indexer
and reuse the previous full layer's top-k, carried in the decoder's layer state (shared_topk.py); dense/MoE patterns
other than the first layers dense are refused on import. Kimi K2 (kimi_k2) is
DeepSeek-V3's architecture at other sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, layers, moe, mtp, standard_layers
from maxtrain.models.families.deepseek import indexer, indexer_training, mla, selected, selected_context, shared_topk
from maxtrain.models.layers import LayerType
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["deepseek"]  # its Hugging Face model_type and architecture
ROUTER = "sigmoid_group_topk"


def layer_types(config) -> list[LayerType]:
    """MLA in every layer, under the indexer's top-k ("dsa") where the model has one (DeepSeek-V3.2, GLM-5); GLM-5's
    "shared" indexer layers (indexer_types) reuse the previous layer's choice, kinds "dense_shared_topk" and
    "moe_shared_topk" (no indexer weights)."""
    def one(i, shared):
        mixer = {"mixer": "dsa", "topk": config.index_topk, "shared_topk": shared} if config.index_n_heads > 0 else {
            "mixer": "mla"}
        suffix = "_shared_topk" if shared else ""
        if i < config.first_num_dense_layers:
            return LayerType(kind="dense" + suffix, **mixer)
        return LayerType(kind="moe" + suffix, mlp="moe+shared" if config.shared_experts else "moe", **mixer)
    return [one(i, shared) for i, shared in enumerate(shared_topk.shared_layers(config))]


def rope_head_dim(config) -> int:
    """RoPE rotates MLA's qk_rope_head_dim features (one key shared by every head), not the whole head."""
    return config.qk_rope_head_dim


def param_specs(model):
    config = model.config
    shared = {"attn_norm": blocks.norm_spec(config), **mla.specs(config), "mlp_norm": blocks.norm_spec(config)}
    attention = {**shared, **(indexer.specs(config) if config.index_n_heads > 0 else {})}
    per_kind = {"dense": {**attention, **blocks.mlp_specs(config)}, "moe": {**attention, **moe.specs(config)},
                "dense_shared_topk": {**shared, **blocks.mlp_specs(config)},  # GLM-5's shared indexer layers
                "moe_shared_topk": {**shared, **moe.specs(config)}}
    out = {**blocks.embedding_specs(config), "layers": standard_layers.stacks(config, model.layer_types, per_kind)}
    if config.mtp_num_layers > 0:
        out["mtp"] = mtp.specs(config, per_kind["moe"])
    return out


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps = config.normalization_layer_epsilon
    h, aux = _attention(blocks.rms_norm(x, p["attn_norm"], eps), p, inputs, layer_type, config, rt)
    x = shard(x + h, ("batch", "length", "embed"))
    normed = blocks.rms_norm(x, p["mlp_norm"], eps)
    if layer_type.is_moe:
        h, moe_aux = moe.block(normed, p, inputs.segment_ids, config, rt, router=ROUTER,
                               num_moe_layers=config.base_num_decoder_layers - config.first_num_dense_layers,
                               routing=inputs.routing)
        aux = {**aux, **moe_aux}
    else:
        h = blocks.mlp(normed, p, rt, "silu")
    return shard(x + h, ("batch", "length", "embed")), aux


def _attention(normed, p, inputs, layer_type: LayerType, config, rt):
    """MLA, under DeepSeek-V3.2's indexer where the layer has one ("dsa") and the keys outnumber its top-k."""
    if layer_type.mixer != "dsa":
        return mla.attention(normed, p, inputs, config, rt)
    if inputs.cache is None and config.indexer_training != "none":
        if not layer_type.shared_topk:
            return indexer_training.attention(normed, p, inputs, config, rt, _selected_keys)
        if config.indexer_training == "dense_warmup":  # a shared layer has no indexer to train: every key
            return mla.attention(normed, p, inputs, config, rt)
    if inputs.state is not None:  # some layers share their indexer's choice (GLM-5): it travels in the state
        return _attention_sharing_topk(normed, p, inputs, layer_type, config, rt)
    index_cache = None
    if inputs.cache is not None:  # decoding: MLA's two entries, then the indexer keys' (layer_cache)
        cache_c, cache_r, index_cache, index, first = inputs.cache
        inputs = inputs._replace(cache=(cache_c, cache_r, index, first))
        index_cache = _cached_index_keys(normed, p, index_cache, index, inputs.rope["global"], config)
    kept = selected_keys = None
    if index_cache is None and normed.shape[1] > config.index_topk:  # training, scoring: the chosen keys alone
        selected_keys = functools.partial(_selected_keys, normed, p, inputs.segment_ids, config,
                                          rt.backend if rt.attention == "flash" else None)
    elif index_cache is not None and index_cache.shape[1] > config.index_topk:  # decoding: the cache slots' mask
        kept = functools.partial(indexer.keys_kept, p=p, segment_ids=inputs.segment_ids, topk=config.index_topk,
                                 cached_keys=index_cache[:, :, 0], interleave=config.index_rope_interleave,
                                 dtype=config.indexer_dtype)
    h, aux = mla.attention(normed, p, inputs, config, rt, keys_kept=kept, selected_keys=selected_keys)
    if index_cache is not None:
        aux = {**aux, "cache": (*aux["cache"], index_cache)}
    return h, aux


def _cached_index_keys(normed, p, index_cache, index, rope, config):
    """The layer's indexer-key cache with this step's keys written at slot `index`."""
    new_keys = indexer.keys(normed, p, rope, config.index_rope_interleave).astype(index_cache.dtype)
    return jax.lax.dynamic_update_slice_in_dim(index_cache, new_keys[:, :, None], index, axis=1)


def _selected_keys(normed, p, segment_ids, config, kernel, q_nope, q_rope, c, k_rope, q_latent, rope, choice=None,
                   trained: bool = False, hand_on: bool = False):
    """MLA over the index_topk keys the indexer chooses for each query, read alone (selected.py): by the
    selected-key Pallas kernel on `kernel`'s platform where the runtime resolved attention to flash, else in plain
    jnp. choice: the keys already chosen (idx, kept: a shared indexer layer's), the indexer not run. trained (the
    sparse stage of indexer_training): the indexer's scores with its weights' gradient and aux's "indexer_kl" its
    KL over each query's selected keys (selected.attention's indexer_kl); hand_on (shared layers follow): the keys
    chosen first (selected.chosen), attended to and handed on in aux's "state". Under context parallelism both run
    per device over the gathered keys (selected_context.py)."""
    index_q = index_w = index_k = None
    interleave, more = config.index_rope_interleave, {}
    if choice is None or trained:
        index_q, index_w = indexer.queries(normed, q_latent, p, rope, interleave, trained=trained)
        index_k = indexer.keys(normed, p, rope, interleave, trained=trained)
    reorder = config.context_parallel_reorder_strategy  # context parallelism: selected_context.py
    if hand_on:
        choice = selected_context.chosen(*(jax.lax.stop_gradient(a) for a in (index_q, index_w, index_k)),
                                         segment_ids, topk=config.index_topk, reorder=reorder,
                                         dtype=config.indexer_dtype)
        more["state"] = choice
    clip = config.qk_clip_threshold > 0  # QK-clip reads each head's largest logit
    out = selected_context.attention(q_nope, q_rope, c, k_rope, p["wkv_b"][..., :config.qk_nope_head_dim], index_q,
                                     index_w, index_k, segment_ids, topk=config.index_topk,
                                     scale=mla.softmax_scale(config), reorder=reorder, with_max_logits=clip,
                                     kernel=kernel, choice=choice, indexer_kl=trained, dtype=config.indexer_dtype)
    if trained:
        out, more["indexer_kl"] = out
    return (*(out if clip else (out, None)), more)


def _attention_sharing_topk(normed, p, inputs, layer_type: LayerType, config, rt):
    """DSA where some layers share their choice (GLM-5's indexer_types, shared_topk.py): a full layer chooses its
    keys first (selected.chosen; decoding: indexer.choose over the cache's slots) and hands them on in aux["state"],
    a shared layer attends to the keys in inputs.state; both then run selected.py (its plain or kernel form) or,
    decoding, MLA's masked form over those keys. At or below index_topk keys every key is kept and nothing chosen."""
    rope, seg, topk = inputs.rope["global"], inputs.segment_ids, config.index_topk
    own = not layer_type.shared_topk
    if inputs.cache is None:
        if normed.shape[1] <= topk:
            return mla.attention(normed, p, inputs, config, rt)
        choice = inputs.state
        if own:
            q_latent = mla.query_latent(normed, p, config, rt)
            index_q, index_w = indexer.queries(normed, q_latent, p, rope, config.index_rope_interleave)
            choice = selected_context.chosen(index_q, index_w, indexer.keys(normed, p, rope,
                                                                            config.index_rope_interleave),
                                             seg, topk=topk, reorder=config.context_parallel_reorder_strategy,
                                             dtype=config.indexer_dtype)
        kernel = rt.backend if rt.attention == "flash" else None
        h, aux = mla.attention(normed, p, inputs, config, rt, selected_keys=functools.partial(
            _selected_keys, normed, p, seg, config, kernel, choice=choice))
        return h, ({**aux, "state": choice} if own else aux)
    index_cache = None
    if own:  # MLA's two entries, then the indexer keys' (layer_cache); a shared layer caches no indexer key
        cache_c, cache_r, index_cache, index, first = inputs.cache
        inputs = inputs._replace(cache=(cache_c, cache_r, index, first))
        index_cache = _cached_index_keys(normed, p, index_cache, index, rope, config)
    cache_c, _, index, first = inputs.cache
    slots, kept, choice = cache_c.shape[1], None, inputs.state
    if slots > topk:
        if own:
            visible = mla.decoding_mask(index, first, normed.shape[1], slots)
            scores = indexer.scores(normed, mla.query_latent(normed, p, config, rt), index_cache[:, :, 0], p, rope,
                                    config.index_rope_interleave, dtype=config.indexer_dtype)
            choice = indexer.choose(scores, visible, topk)
        chosen_mask = shared_topk.mask(choice, slots)
        kept = lambda *_: chosen_mask  # noqa: E731  (the slots' mask already holds the visible ones alone)
    h, aux = mla.attention(normed, p, inputs, config, rt, keys_kept=kept)
    if own:
        aux = {**aux, "cache": (*aux["cache"], index_cache), "state": choice}
    return h, aux


def layer_cache(config, layer_type, batch: int, max_length: int, kv_heads) -> dict:
    """MLA's latent and RoPE key; with the indexer, its key [B, S, 1, index_head_dim] too (float32, as it scores)."""
    out = contract.kv_layer_cache(config, layer_type, batch, max_length, kv_heads)
    if config.index_n_heads > 0 and not layer_type.shared_topk:
        out["index_k"] = ((batch, max_length, 1, config.index_head_dim), jnp.float32)
    return out


def sparse(config) -> bool:
    """Whether the indexer's top-k hides keys at max_target_length (models/runtime.py resolves attention by it)."""
    return config.index_n_heads > 0 and config.max_target_length > config.index_topk


def _indexer_flops(model, dense_attention: bool) -> float:
    """Training FLOPs per token of the indexer where sparse, in the layers that run one (forward only: it takes no
    gradient; it scores the keys before the end of its query's run of blocks, as selected.py computes it:
    selected.scored_keys) and what the attention over the kept keys costs against MLA's over every visible key: selected.py's absorbed form spends 2 x N x (C + Hr) per kept key on the logits and 2 x N x C
    on the latent values (the W_kvb products move from the keys and values to the queries and outputs: the same
    count, in the matmul term), where the expanded form spends 2 x N x (Hn + Hr + Hv) per visible key."""
    config = model.config
    if not sparse(config):
        return 0.0
    n_layers, d = config.base_num_decoder_layers, config.base_emb_dim
    q, n, e = config.q_lora_rank, config.index_n_heads, config.index_head_dim
    visible = blocks.attended_keys(config.max_target_length, 0, dense_attention)
    heads, c = config.base_num_query_heads, config.kv_lora_rank
    per_key = 2 * heads * (mla.qk_head_dim(config) + config.v_head_dim)                  # q.k and p.v, expanded
    per_kept_key = 2 * heads * (2 * c + config.qk_rope_head_dim)                        # absorbed (selected.py)
    kept = layers.attended_keys(config.max_target_length, model.layer_types[-1], dense_attention)  # at most k ("dsa")
    attention = 3.0 * n_layers * (per_kept_key * kept - per_key * visible)
    indexer_keys = selected.scored_keys(config.max_target_length)  # a run of query blocks' prefix each
    choosing = sum(not t.shared_topk for t in model.layer_types)  # GLM-5's shared indexer layers run no indexer
    return choosing * (2 * (q * n * e + d * e + d * n) + 2 * (n * e + n) * indexer_keys) + attention


def flops_per_token(model, dense_attention: bool = False) -> float:
    """Training FLOPs per token: 3 x (2 x the weights a token multiplies + MLA's scores and values), with
    a token's K routed experts, the shared experts and the router in MoE layers (moe.flops_per_token)."""
    config = model.config
    d, f_e = config.base_emb_dim, moe.expert_dim(config)
    routed = d * config.num_experts + (config.num_experts_per_tok + config.shared_experts) * 3 * d * f_e
    mlps = [routed if t.is_moe else 3 * d * config.base_mlp_dim for t in model.layer_types]
    matmul = sum(mla.matmul_params(config) + m for m in mlps) + d * config.vocab_size
    depth = config.mtp_num_layers  # each MTP module: eh_proj, one MoE block and the shared head (models/mtp.py)
    matmul += depth * (2 * d * d + mla.matmul_params(config) + routed + d * config.vocab_size)
    return (3.0 * (2 * matmul + mla.attention_flops(config, config.base_num_decoder_layers + depth, dense_attention))
            + _indexer_flops(model, dense_attention))


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_ATTENTION = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": ("self_attn.q_proj.weight", hf.Linear(1)), "wq_a": ("self_attn.q_a_proj.weight", hf.Linear(1)),
    "q_a_norm": "self_attn.q_a_layernorm.weight", "wq_b": ("self_attn.q_b_proj.weight", hf.Linear(1)),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", hf.Linear(1)), "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": ("self_attn.kv_b_proj.weight", hf.Linear(1)), "wo": ("self_attn.o_proj.weight", hf.Linear(2)),
}
_MOE = {
    "router": ("mlp.gate.weight", hf.Linear(1)), "router_bias": "mlp.gate.e_score_correction_bias",
    "w_gate": ("mlp.experts.{j}.gate_proj.weight", hf.Linear(1)),
    "w_up": ("mlp.experts.{j}.up_proj.weight", hf.Linear(1)),
    "w_down": ("mlp.experts.{j}.down_proj.weight", hf.Linear(1)),
    "shared_gate": ("mlp.shared_experts.gate_proj.weight", hf.Linear(1)),
    "shared_up": ("mlp.shared_experts.up_proj.weight", hf.Linear(1)),
    "shared_down": ("mlp.shared_experts.down_proj.weight", hf.Linear(1)),
}


_INDEXER = {  # DeepSeek-V3.2's
    "index_wq": ("self_attn.indexer.wq_b.weight", hf.Linear(1)), "index_wk": ("self_attn.indexer.wk.weight", hf.Linear(1)),
    "index_k_norm": "self_attn.indexer.k_norm.weight", "index_k_norm_bias": "self_attn.indexer.k_norm.bias",
    "index_weights": ("self_attn.indexer.weights_proj.weight", hf.Linear(1)),
}


def _names(kind: str, table: dict) -> dict:
    return {f"layers/{kind}/{name}": (f"model.layers.{{i}}.{v}", hf.SAME) if isinstance(v, str)
            else (f"model.layers.{{i}}.{v[0]}", v[1]) for name, v in table.items()}


# The MTP modules (params["mtp"]); "{i}" is num_hidden_layers + the module's index (checkpointing/convert.py).
# Their embed_tokens and shared_head.head are copies of the model's, which maxtrain shares instead.
_MTP = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": ("eh_proj.weight", hf.Linear(1)),
        "final_norm": "shared_head.norm.weight", **_ATTENTION, **_MOE}
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

HF_NAMES = {**hf.EMBEDDING_NAMES, **_names("dense", _ATTENTION), **_names("moe", _ATTENTION), **_names("moe", _MOE),
            **_names("dense", _INDEXER), **_names("moe", _INDEXER),
            **hf.for_kind(hf.MLP_NAMES, "dense"),  # GLM-5's shared indexer layers: the same, with no indexer
            **_names("dense_shared_topk", _ATTENTION), **hf.for_kind(hf.MLP_NAMES, "dense_shared_topk"),
            **_names("moe_shared_topk", _ATTENTION), **_names("moe_shared_topk", _MOE),
            **{k.replace("layers/mtp/", "mtp/"): v for k, v in _names("mtp", _MTP).items()}}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    """maxtrain's keys from config.json; a field the file omits takes transformers' DeepseekV3Config default
    (n_group 8, topk_group 4, routed_scaling_factor 2.5, q_lora_rank 1536, ...), as transformers reads it."""
    # DeepSeek-V3's router: sigmoid scores, top-k within the best groups by the biased scores (noaux_tc)
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid",
                       "topk_method": "noaux_tc"})
    rope = hf.rope_dict(config, notes)
    heads = hf.require(config, "num_attention_heads")
    nope, rope_dim = int(hf.require(config, "qk_nope_head_dim")), int(hf.require(config, "qk_rope_head_dim"))
    glm = config.get("model_type") == "glm_moe_dsa"
    v32 = glm or config.get("model_type") == "deepseek_v32"  # MLA's RoPE always interleaved there (no such field)
    if glm:
        _refuse_glm_mlp_pattern(config)
    groups = hf.count(config, "n_group", 1 if glm else 8, null=1)
    top_groups = hf.count(config, "topk_group", 1 if glm else 4, null=groups)
    return {**hf.common_keys(config), **hf.rope_keys(config, notes, rope=rope),
            "base_num_kv_heads": heads, "head_dim": nope + rope_dim,
            "num_experts": int(hf.require(config, "n_routed_experts")),
            "num_experts_per_tok": int(hf.require(config, "num_experts_per_tok")),
            "base_moe_mlp_dim": int(hf.require(config, "moe_intermediate_size")),
            "shared_experts": hf.count(config, "n_shared_experts", 1, least=0, null=0),
            "n_routing_groups": groups if groups > 1 else -1,
            "topk_routing_group": top_groups if groups > 1 else -1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 2.5)),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)), "routed_bias": True,
            "first_num_dense_layers": hf.count(config, "first_k_dense_replace", 3, least=0, null=0),
            "q_lora_rank": hf.count(config, "q_lora_rank", 1536, least=0, null=0),
            "kv_lora_rank": int(hf.require(config, "kv_lora_rank")),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope_dim, "v_head_dim": int(hf.require(config, "v_head_dim")),
            "rope_interleave": True if v32 else bool(config.get("rope_interleave", True)),
            "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
            **({"index_n_heads": hf.count(config, "index_n_heads", 32 if glm else 64),
                "index_head_dim": hf.count(config, "index_head_dim", 128, least=2),
                "index_topk": hf.count(config, "index_topk", 2048), "index_rope_interleave": glm,
                "indexer_types": _glm_indexer_types(config) if glm else []}
               if v32 else {"index_n_heads": 0})}


def _glm_indexer_types(config: dict) -> list[str]:
    """GLM-5's indexer_types ("full" or "shared" per layer) as transformers' GlmMoeDsaConfig reads them: the list,
    else index_topk_pattern ("F"/"S" per layer, or a list), else index_topk_freq and index_skip_topk_offset; [] where
    every layer is full. A first layer "shared" (no choice before it to reuse) is refused."""
    n = int(hf.require(config, "num_hidden_layers"))
    kinds, pattern = config.get("indexer_types"), config.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if kinds is None:
        freq, offset = max(int(config.get("index_topk_freq", 1)), 1), int(config.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    kinds = list(kinds)
    if len(kinds) != n or any(k not in ("full", "shared") for k in kinds):
        raise hf.ConversionError(f"config.json's indexer_types must be \"full\" or \"shared\" for each of its {n} "
                                 f"layers, got {kinds}")
    if kinds and kinds[0] == "shared":
        raise hf.ConversionError("config.json's indexer_types starts with \"shared\": a shared layer reuses the "
                                 "previous full layer's top-k and the first layer has none; make it \"full\"")
    return kinds if "shared" in kinds else []


def _refuse_glm_mlp_pattern(config: dict) -> None:
    """GLM-5's mlp_layer_types, where it says what this family does not build: dense and MoE layers other than the
    first first_k_dense_replace dense."""
    mlp = config.get("mlp_layer_types")
    dense = hf.count(config, "first_k_dense_replace", 3, least=0, null=0)
    if mlp is not None and list(mlp) != ["dense"] * dense + ["sparse"] * (len(mlp) - dense):
        raise hf.ConversionError(f"config.json's mlp_layer_types is not the first first_k_dense_replace={dense} "
                                 "layers dense and the rest MoE ('sparse'), the one pattern maxtrain's deepseek "
                                 "family builds")


def to_hf_config(keys: dict) -> dict:
    rope = hf.rope_parameters(keys)
    if keys["rope_type"] != "default" and keys["rope_mscale_all_dim"] > 0:
        rope["mscale_all_dim"] = keys["rope_mscale_all_dim"]  # the scores' scale; cos and sin: attention_factor
    groups = keys["n_routing_groups"] if keys["n_routing_groups"] > 0 else 1
    out = {**hf.common_config(keys, FAMILY), "rope_parameters": rope, "rope_theta": keys["rope_max_timescale"],
           "hidden_act": "silu", "attention_bias": False,
           "n_routed_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
           "moe_intermediate_size": keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"], "n_shared_experts": keys["shared_experts"],
           "n_group": groups, "topk_group": keys["topk_routing_group"] if keys["topk_routing_group"] > 0 else groups,
           "routed_scaling_factor": keys["routed_scaling_factor"], "norm_topk_prob": keys["norm_topk_prob"],
           "first_k_dense_replace": keys["first_num_dense_layers"], "q_lora_rank": keys["q_lora_rank"] or None,
           "kv_lora_rank": keys["kv_lora_rank"], "qk_nope_head_dim": keys["qk_nope_head_dim"],
           "qk_rope_head_dim": keys["qk_rope_head_dim"], "v_head_dim": keys["v_head_dim"],
           "rope_interleave": keys["rope_interleave"], "num_nextn_predict_layers": 0}
    out["head_dim"] = keys["qk_rope_head_dim"]  # transformers' DeepseekV3Config: the RoPE width
    if keys.get("index_n_heads", 0) > 0:  # DeepSeek-V3.2: its own model_type, an interleaved RoPE with no field for it
        if not keys["rope_interleave"]:
            raise hf.ConversionError("DeepSeek-V3.2 (index_n_heads > 0) exports with MLA's RoPE interleaved, as "
                                     "transformers' DeepseekV32 computes it; this model has rope_interleave=false")
        del out["rope_interleave"], out["num_nextn_predict_layers"]
        glm = keys.get("index_rope_interleave", False)  # GLM-5: the indexer's RoPE interleaved
        out.update(model_type="glm_moe_dsa" if glm else "deepseek_v32",
                   architectures=["GlmMoeDsaForCausalLM" if glm else "DeepseekV32ForCausalLM"],
                   index_n_heads=keys["index_n_heads"], index_head_dim=keys["index_head_dim"],
                   index_topk=keys["index_topk"])
        if keys.get("indexer_types") and not glm:
            raise hf.ConversionError("shared indexer layers (indexer_types) export as GLM-5's (glm_moe_dsa, "
                                     "index_rope_interleave=true); DeepSeek-V3.2 has none: set indexer_types=[]")
        if keys.get("indexer_types"):  # GLM-5's shared indexer layers
            out["indexer_types"] = list(keys["indexer_types"])
    return out


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config, rope_head_dim=rope_head_dim,
    cache_heads=mla.cache_heads, mtp_copies=MTP_COPIES, layer_cache=layer_cache,
    layer_state=shared_topk.layer_state)

"""DeepSeek-V4 (transformers' deepseek_v4): hyper-connected residual streams, compressed attention, hash routing.

    X      = embed(tokens) copied into hc_mult streams                          [B, T, N, D]
    layer  (post, comb, h) = attn_hc(X); X = merge(post, comb, attention(norm(h)), X)
           (post, comb, h) = ffn_hc(X);  X = merge(post, comb, moe(norm(h), tokens), X)
    logits = lm_head(norm(hyper_head(X)))

Its parts are pure functions over transformers' module names, each checked against transformers 5.24
(tests/models/test_deepseek_v4_parts.py): hyper.py (hyper-connections, Sinkhorn, the hyper head), compressed.py (HCA
and CSA compressors, the indexer, sliding window + compressed attention with sinks, grouped output projection),
packed.py (the compressors' windows and the entries each query reads in a row of packed documents),
routing.py (sqrtsoftplus top-k and hash routing, clamped SwiGLU experts; their dense reference form), model.py (one
layer and the whole forward), cache.py (the decoding cache and the attention over it), decode.py (one token a step
alone, the reference the decoder's path is checked beside), flops.py, checkpoint.py (save_pretrained's names <->
the module names, for the parts' tests); config/deepseek_v4_dims.py holds the sizes and the config checks its registry row runs.

How it plugs into the shared decoder (models/decoder.py). The residual is hc_mult streams, and the decoder hands a
layer one array x: here x is the streams flattened, [B, T, N D]. `embed` tiles the embedding into the N streams,
`layer` reshapes x to [B, T, N, D] and back, `logits` runs the hyper head. This is the simplest form the contract
allows: the decoder's scan, remat, segments and the tiled loss carry x without knowing its width, and no new
contract field is needed (a `layer_state` would carry the streams beside an x no layer reads). The hash-routed
layers read the token ids (tid2eid[token]): they reach each layer as its `per_layer_inputs` (the ids repeated per
layer, [L, B, T] int32), the one contract input that carries something of the tokens to a layer. tid2eid is a
fixed parameter (ParamSpec.fixed: never trained), kept as floats (exact below 2^24 experts) and read as int32.

Parameters keep transformers' module names and torch's [out, in] layout, nested: layer l's
`self_attn.q_a_proj.weight` is params["layers"][kind]["self_attn"]["q_a_proj"]["weight"][i]; the experts are
w1, w3 (gate, up) [E, I, D] and w2 (down) [E, D, I] as save_pretrained writes them per expert, with the logical axes
of the shared MoE block's experts ("exp", "mlp", "embed" in that layout). The other projections split too
(_layer_specs): their input axis over FSDP ("embed"), the query, indexer and output-group heads over tensor
parallelism ("heads"), the shared expert's width over it ("mlp"); the norms, sinks, biases and the compressors'
position biases stay whole (tests/models/test_deepseek_v4_sharding.py). A layer's kind is its attention and router,
"<sliding|csa|hca>_<moe|hash>": the kinds differ in their parameters.

The experts. The layer routes each token itself (routing.route: tid2eid[token] in the hash layers, a sqrtsoftplus
top-k with the selection bias after them) and runs the routed experts through the shared MoE block (models/moe/,
`moe_block` here): router "given" (the block takes the experts and weights as they are), activation "clamped_silu",
so moe_dispatch (dropless grouped matmuls or capacity), expert parallelism and FSDP apply as in the other MoE
families; the shared expert runs beside it. It equals routing.moe, the dense reference form (every expert on every
token) the parts' tests check against transformers, on every real token (tests/models/test_deepseek_v4_moe.py);
padding tokens get no routed experts. The block reports the loads (moe_load_min/max, and moe_dropped_fraction
under capacity dispatch); V4 has no router logits for a balance or z loss, so none is computed: the registry row
fixes load_balance_loss_weight and router_z_loss_weight at 0 (config/features.py resolves base.yml's 0.01 to it and
refuses a user's other value).

Packed documents: the layers read the segment ids, and each document is compressed and attended as if it ran
alone from position 0 (packed.py; padding, segment id 0, is a document no real token sees).

Decoding (maxtrain.decode, training's sample, the rollouts) runs through the shared decoder's cache: `layer_cache`
declares each layer's buffers (cache.py: the window's keys, a compressed layer's compressor and indexer projections,
the length rounded up to whole windows), and `layer` runs cache.attention over them: a prompt's prefill writes its
tokens at once (its closed entries pooled from them), each later token its slot; a left-padded row's windows are
pooled from its first slot.

Context parallelism (all_gather alone): each device attends its queries to the whole sequence's keys and compressed
entries, computed from the layer input gathered back into the sequence's order (compressed_context.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config import deepseek_v4_dims, registry
from maxtrain.models import contract, hf
from maxtrain.models import moe
from maxtrain.models.layers import LayerType
from maxtrain.models.params import ParamSpec, dense, stacked

from . import cache as cache_lib, checkpoint, compressed_context, flops, hyper, model as v4_model, routing
from .compressed import rms
from .hf_config import from_hf_config, to_hf_config

FAMILY = registry.FAMILIES["deepseek_v4"]

ATTENTION_SHORT = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                   "heavily_compressed_attention": "hca"}
ATTENTION_LONG = {v: k for k, v in ATTENTION_SHORT.items()}


def _kinds(config) -> list[str]:
    d = deepseek_v4_dims.dims_from_keys(config)
    return [f"{ATTENTION_SHORT[a]}_{'hash' if m == 'hash_moe' else 'moe'}"
            for a, m in zip(d.layer_types, d.mlp_layer_types)]


def layer_types(config) -> list[LayerType]:
    """Every layer attends a sliding window; CSA layers also the entries compressed every csa_rate tokens, of
    which the indexer keeps index_topk per query; HCA layers every closed entry of hca_rate tokens."""
    d = deepseek_v4_dims.dims_from_keys(config)
    rates = {"sliding": (0, 0), "csa": (d.csa_rate, d.index_topk), "hca": (d.hca_rate, 0)}
    return [LayerType(kind=kind, mixer="compressed", attention="sliding", window=config.sliding_window_size,
                      rope=None, mlp="moe+shared", compress=rates[kind.split("_")[0]][0],
                      topk=rates[kind.split("_")[0]][1])
            for kind in _kinds(config)]


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def _w(out_dim, in_dim, out_axis=None, in_axis="embed"):
    """A torch Linear weight [out, in]: the input axis is split over FSDP ("embed"), the output axis over tensor
    parallelism where it is a head (or expert width) axis ("heads", "mlp")."""
    return {"weight": dense((out_dim, in_dim), (out_axis, in_axis), in_dim)}


def _norm(width):
    return {"weight": ParamSpec((width,), (None,), "ones")}


def _hc(d):
    n = d.hc_mult
    return {"fn": dense(((2 + n) * n, n * d.hidden_size), (None, "embed"), n * d.hidden_size),
            "base": ParamSpec(((2 + n) * n,), (None,), "zeros"), "scale": ParamSpec((3,), (None,), "ones")}


def _compressor(width, pooled, rate, d):
    """width: the kv/gate rows (HCA: Dh; CSA: 2 Dh, two overlapping halves; the indexer's 2 E); pooled: the entry's
    width kv_norm scales."""
    return {"kv_proj": _w(width, d.hidden_size), "gate_proj": _w(width, d.hidden_size),
            "position_bias": ParamSpec((rate, width), (None, None), "zeros"), "kv_norm": _norm(pooled)}


def _layer_specs(kind: str, d) -> dict:
    """One layer's parameters with their logical axes: every projection's input axis over FSDP ("embed": the
    hidden size, the query latent, a group's heads), the query heads, the output groups (each a block of heads)
    and the indexer's heads over tensor parallelism ("heads"), the experts' widths over it ("mlp"); the small ones
    (norms, sinks, biases, the compressors' position biases) whole on every device."""
    attn, router = kind.split("_")
    hd = d.num_heads * d.head_dim
    self_attn = {"q_a_proj": _w(d.q_lora_rank, d.hidden_size), "q_a_norm": _norm(d.q_lora_rank),
                 "q_b_proj": _w(hd, d.q_lora_rank, "heads"), "kv_proj": _w(d.head_dim, d.hidden_size),
                 "kv_norm": _norm(d.head_dim),
                 "o_a_proj": _w(d.o_groups * d.o_lora_rank, hd // d.o_groups, "heads"),
                 "o_b_proj": _w(d.hidden_size, d.o_groups * d.o_lora_rank, "embed", "heads"),
                 "sinks": ParamSpec((d.num_heads,), (None,), "zeros")}
    if attn == "hca":
        self_attn["compressor"] = _compressor(d.head_dim, d.head_dim, d.hca_rate, d)
    elif attn == "csa":
        indexer = _compressor(2 * d.index_head_dim, d.index_head_dim, d.csa_rate, d)
        indexer.update(q_b_proj=_w(d.index_n_heads * d.index_head_dim, d.q_lora_rank, "heads"),
                       scorer={"weights_proj": _w(d.index_n_heads, d.hidden_size)})
        self_attn["compressor"] = {**_compressor(2 * d.head_dim, d.head_dim, d.csa_rate, d), "indexer": indexer}
    e, i, hidden = d.n_experts, d.moe_intermediate, d.hidden_size
    gate = {"weight": dense((e, hidden), (None, "embed"), hidden)}
    if router == "hash":
        gate["tid2eid"] = ParamSpec((d.vocab_size, d.top_k), ("vocab", None), "zeros", fixed=True)
    else:
        gate["e_score_correction_bias"] = ParamSpec((e,), (None,), "zeros", fixed=True)
    mlp = {"gate": gate,
           # the logical axes of the shared MoE block's experts (models/moe/), in torch's [out, in] layout
           "experts": {"w1": dense((e, i, hidden), ("exp", "mlp", "embed"), hidden),
                       "w3": dense((e, i, hidden), ("exp", "mlp", "embed"), hidden),
                       "w2": dense((e, hidden, i), ("exp", "embed", "mlp"), i)},
           "shared_experts": {"gate_proj": _w(i, hidden, "mlp"), "up_proj": _w(i, hidden, "mlp"),
                              "down_proj": _w(hidden, i, "embed", "mlp")}}
    return {"attn_hc": _hc(d), "ffn_hc": _hc(d), "input_layernorm": _norm(hidden),
            "post_attention_layernorm": _norm(hidden), "self_attn": self_attn, "mlp": mlp}


def param_specs(model):
    config = model.config
    d = deepseek_v4_dims.dims_from_keys(config)
    kinds = [t.kind for t in model.layer_types]
    n = d.hc_mult
    return {"token_embedding": ParamSpec((d.vocab_size, d.hidden_size), ("vocab", "embed"), "normal", 1.0),
            "final_norm": _norm(d.hidden_size)["weight"],
            "lm_head": dense((d.vocab_size, d.hidden_size), ("vocab", "embed"), d.hidden_size),
            "hc_head": {"fn": dense((n, n * d.hidden_size), (None, "embed"), n * d.hidden_size),
                        "base": ParamSpec((n,), (None,), "zeros"), "scale": ParamSpec((1,), (None,), "ones")},
            "layers": {kind: stacked(_layer_specs(kind, d), kinds.count(kind)) for kind in dict.fromkeys(kinds)}}


# --------------------------------------------------------------------------------------------
# The stack: embed, layer, logits
# --------------------------------------------------------------------------------------------


def embed(params, tokens, config, rt):
    """x [B, T, N D]: the embedding copied into the hc_mult streams, flattened."""
    x = params["token_embedding"].astype(rt.dtype)[tokens]
    return jnp.tile(x, (1, 1, config.hc_mult))


def per_layer_inputs(params, tokens, x, config, rt):
    """The token ids, for every layer ([L, B, T]): the hash-routed layers look their experts up by them."""
    return jnp.broadcast_to(tokens.astype(jnp.int32)[None], (config.base_num_decoder_layers,) + tokens.shape)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _module_params(p, dtype, experts: bool = True) -> dict:
    """One layer's nested parameters -> {transformers' module name: array} as model.decoder_layer reads them;
    experts=False leaves the routed experts out (the shared MoE block reads them nested)."""
    flat = {}
    for name, value in _flat(p).items():
        if not experts and name.startswith("mlp.experts."):
            continue
        if name.endswith(("tid2eid", "e_score_correction_bias")):
            value = jax.lax.stop_gradient(value)
            flat[name] = value.astype(jnp.int32) if name.endswith("tid2eid") else value.astype(jnp.float32)
        else:
            flat[name] = value.astype(dtype)
    if not experts:
        return flat
    experts = "mlp.experts."
    flat[experts + "gate_up_proj"] = jnp.concatenate([flat.pop(experts + "w1"), flat.pop(experts + "w3")], axis=1)
    flat[experts + "down_proj"] = flat.pop(experts + "w2")
    return flat


def layer(x, p, inputs, layer_type, model, rt):
    config = model.config
    d = deepseek_v4_dims.dims_from_keys(config)
    attn, router = layer_type.kind.split("_")
    kind, mlp_kind = ATTENTION_LONG[attn], "hash_moe" if router == "hash" else "moe"
    b, t, _ = x.shape
    streams = x.reshape(b, t, d.hc_mult, d.hidden_size)
    flat = _module_params(p, x.dtype, experts=False)
    aux = {}

    def moe_fn(h, ids, is_hash):
        y, aux_moe = moe_block(h, ids, is_hash, v4_model.sub(flat, "mlp."), p["mlp"]["experts"], inputs.segment_ids,
                               config, rt, d)
        aux.update(aux_moe)
        return y

    if inputs.cache is None:
        attend = functools.partial(compressed_context.attention, reorder=config.context_parallel_reorder_strategy)
        streams = v4_model.decoder_layer(flat, streams, inputs.per_layer, inputs.positions, kind, mlp_kind, d,
                                         inputs.segment_ids, moe_fn, attend)
        return streams.reshape(b, t, -1).astype(x.dtype), aux
    *buffers, index, first = inputs.cache
    names = cache_lib.NAMES[kind]
    streams, new = v4_model.decoder_layer_cached(flat, streams, inputs.per_layer, inputs.positions, index, kind,
                                                 mlp_kind, d, dict(zip(names, buffers)), first, moe_fn)
    return streams.reshape(b, t, -1).astype(x.dtype), {**aux, "cache": tuple(new[n] for n in names)}


def layer_cache(config, layer_type, batch: int, max_length: int, kv_heads) -> dict:
    """A layer's decoding cache (cache.py): the sliding window's keys, and a compressed layer's compressor (and
    indexer) projections, max_length rounded up to whole windows; the names differ by kind."""
    d = deepseek_v4_dims.dims_from_keys(config)
    kind = ATTENTION_LONG[layer_type.kind.split("_")[0]]
    return {name: (shape, None) for name, shape in cache_lib.layer_shapes(d, kind, batch, max_length).items()}


def moe_block(h, ids, is_hash, mlp, experts, segment_ids, config, rt, d):
    """The layer's MoE through the shared block (models/moe/): routed here (routing.route: hash or sqrtsoftplus
    top-k), the experts run by moe.block with router "given" and activation "clamped_silu" (dropless or capacity
    dispatch, grouped matmuls, expert parallelism), plus the shared expert. h [B, T, D], ids [B, T]; mlp: the
    gate's and shared expert's weights by transformers' names; experts: w1, w3 [E, I, D] and w2 [E, D, I].
    -> ([B, T, D], the block's aux). Equals routing.moe (the dense reference) on every real token."""
    b, t, hidden = h.shape
    flat = h.reshape(b * t, hidden)
    w, idx = routing.route(mlp, flat, ids.reshape(-1), is_hash=is_hash, top_k=d.top_k, scaling=d.routed_scaling)
    # torch's [out, in] -> the block's [E, D, F] and [E, F, D]
    weights = {"w_gate": jnp.swapaxes(experts["w1"], 1, 2), "w_up": jnp.swapaxes(experts["w3"], 1, 2),
               "w_down": jnp.swapaxes(experts["w2"], 1, 2)}
    segments = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    y, aux = moe.block(h, weights, segments, config, rt, router=moe.GIVEN,
                       num_moe_layers=config.base_num_decoder_layers, activation="clamped_silu",
                       given=(w.reshape(b, t, -1), idx.reshape(b, t, -1)))
    return y + routing.shared(mlp, flat, limit=d.swiglu_limit).reshape(b, t, hidden).astype(y.dtype), aux


def logits(params, x, config, rt):
    d = deepseek_v4_dims.dims_from_keys(config)
    b, t, _ = x.shape
    streams = x.reshape(b, t, d.hc_mult, d.hidden_size)
    head = params["hc_head"]
    h = hyper.hyper_head(head["fn"], head["base"], head["scale"], streams, hc_eps=d.hc_eps, rms_eps=d.rms_eps)
    h = rms(h, params["final_norm"], d.rms_eps).astype(x.dtype)
    return (h @ params["lm_head"].astype(x.dtype).T).astype(jnp.float32)


def flops_per_token(model, dense_attention: bool = False) -> float:
    """Counts the keys each query reads (flops.py); dense_attention: every key and entry, as the reference form
    computes them (the experts are counted as routed: k + 1 per token)."""
    return flops.flops_per_token(deepseek_v4_dims.dims_from_keys(model.config), model.config.max_target_length,
                                 dense=dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


class _Ids(hf.Same):
    """tid2eid: an int64 table in the checkpoint, a float parameter here (read back as int32)."""

    integers = True

    def export(self, w, out, name, dtype):
        out[name] = np.rint(np.asarray(w, np.float64)).astype(np.int64)


_IDS = _Ids()


def _layer_names() -> dict:
    """Every layer parameter of every kind: maxtrain path -> (saved name, layout)."""
    table = {}
    # Spec a maximal layer of each kind with throwaway sizes, only to list its parameter paths.
    probe = deepseek_v4_dims.Dims(hidden_size=2, num_heads=1, head_dim=2, rope_dim=2, q_lora_rank=2, o_groups=1,
                          o_lora_rank=2, sliding_window=1, rms_eps=1e-6, rope_theta=1.0, compress_rope_theta=1.0,
                          csa_rate=1, hca_rate=1, index_n_heads=1, index_head_dim=2, index_topk=1, hc_mult=1,
                          hc_iters=1, hc_eps=1e-6, n_experts=1, top_k=1, routed_scaling=1.0, swiglu_limit=1.0,
                          moe_intermediate=2, vocab_size=2, layer_types=(), mlp_layer_types=())
    for attn in ATTENTION_LONG:
        for router in ("moe", "hash"):
            kind = f"{attn}_{router}"
            for name in _flat(_layer_specs(kind, probe)):
                path = f"layers/{kind}/" + name.replace(".", "/")
                if name.startswith("mlp.experts."):
                    saved = f"model.layers.{{i}}.ffn.experts.{{j}}.{name.rsplit('.', 1)[1]}.weight"
                else:
                    saved = checkpoint._back(f"model.layers.{{i}}.{name}")  # pylint: disable=protected-access
                table[path] = (saved, _IDS if name.endswith("tid2eid") else hf.SAME)
    return table


HF_NAMES = {"token_embedding": ("model.embed_tokens.weight", hf.SAME), "final_norm": ("model.norm.weight", hf.SAME),
            "lm_head": ("head.weight", hf.SAME), "hc_head/fn": ("model.hc_head.hc_fn", hf.SAME),
            "hc_head/base": ("model.hc_head.hc_base", hf.SAME), "hc_head/scale": ("model.hc_head.hc_scale", hf.SAME),
            **_layer_names()}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=embed, layer=layer, logits=logits,
    flops_per_token=flops_per_token, hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config,
    per_layer_inputs=per_layer_inputs, layer_cache=layer_cache)

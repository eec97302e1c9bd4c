"""DeepSeek-V4's sizes as one static record (read from transformers' DeepseekV4Config), and the config checks that
refuse what the forward cannot do, each with one line naming the problem and the fix, before anything compiles."""

from __future__ import annotations

from typing import NamedTuple


class Dims(NamedTuple):
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_eps: float
    rope_theta: float
    compress_rope_theta: float
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    n_experts: int
    top_k: int
    routed_scaling: float
    swiglu_limit: float
    moe_intermediate: int
    vocab_size: int
    layer_types: tuple
    mlp_layer_types: tuple
    # The compressed layers' RoPE scaling (their compressors' and indexer's too); sliding-only layers rotate by plain
    # RoPE at rope_theta. 'default' or 'yarn' (the released DeepSeek-V4: factor 16 over a 65,536-token pre-training
    # context); cos and sin are not scaled (the reference's attention factor is 1).
    compress_rope_type: str = 'default'
    compress_rope_factor: float = 1.0
    compress_rope_original_max: int = 0
    compress_rope_beta_fast: float = 32.0
    compress_rope_beta_slow: float = 1.0


def _rope_type(rp, label):
    sub = (rp or {}).get(label) or {}
    return sub.get('rope_type', sub.get('type', 'default'))


def compress_yarn_from_hf(sub: dict) -> dict:
    """Dims' compress_rope_* fields from transformers' rope_parameters['compress'] (YaRN or default RoPE); refuses,
    in one line, what the compressed layers cannot rotate by."""
    kind = sub.get('rope_type', sub.get('type', 'default'))
    if kind == 'default':
        return {}
    if kind != 'yarn':
        raise ValueError(f"deepseek_v4: rope_parameters['compress'] rope_type {kind!r} is not supported; its "
                         "compressed layers rotate by 'default' or 'yarn' RoPE")
    missing = [k for k in ('factor', 'original_max_position_embeddings') if sub.get(k) is None]
    if missing:
        raise ValueError(f"deepseek_v4: rope_parameters['compress'] is YaRN without {' and '.join(missing)}; "
                         "give both (the released DeepSeek-V4: factor 16, original_max_position_embeddings 65536)")
    factor = sub.get('attention_factor')
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"deepseek_v4: rope_parameters['compress'] attention_factor {factor} scales cos and sin, "
                         "which DeepSeek-V4's reference does not (it takes 1.0); remove it or set 1.0")
    return dict(compress_rope_type='yarn', compress_rope_factor=float(sub['factor']),
                compress_rope_original_max=int(sub['original_max_position_embeddings']),
                compress_rope_beta_fast=float(sub.get('beta_fast') or 32.0),
                compress_rope_beta_slow=float(sub.get('beta_slow') or 1.0))


def dims_from_hf(c) -> Dims:
    """The sizes as transformers reads them (c: a DeepseekV4Config, after its __post_init__ folded the legacy keys)."""
    kind = _rope_type(c.rope_parameters, 'main')
    if kind != 'default':
        raise ValueError(f"deepseek_v4: rope_parameters['main'] rope_type {kind!r} is not supported here; the "
                         "sliding-window layers rotate by 'default' RoPE (transformers' DeepSeek-V4 too)")
    yarn = compress_yarn_from_hf(c.rope_parameters['compress'])
    if c.scoring_func != 'sqrtsoftplus':
        raise ValueError(f"deepseek_v4: scoring_func {c.scoring_func!r} is not supported; use 'sqrtsoftplus'")
    return Dims(
        hidden_size=c.hidden_size, num_heads=c.num_attention_heads, head_dim=c.head_dim,
        rope_dim=int(c.head_dim * c.partial_rotary_factor), q_lora_rank=c.q_lora_rank, o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank, sliding_window=c.sliding_window, rms_eps=c.rms_norm_eps,
        rope_theta=float(c.rope_parameters['main']['rope_theta']),
        compress_rope_theta=float(c.rope_parameters['compress']['rope_theta']),
        csa_rate=c.compress_rates['compressed_sparse_attention'],
        hca_rate=c.compress_rates['heavily_compressed_attention'],
        index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim, index_topk=c.index_topk,
        hc_mult=c.hc_mult, hc_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, n_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok, routed_scaling=c.routed_scaling_factor, swiglu_limit=c.swiglu_limit,
        moe_intermediate=c.moe_intermediate_size, vocab_size=c.vocab_size, layer_types=tuple(c.layer_types),
        mlp_layer_types=tuple(c.mlp_layer_types), **yarn)


def check(d: Dims, seq_len: int, hash_table_experts: int | None = None) -> None:
    """Refuse, with one line each, what this forward cannot run: call before compiling.

    hash_table_experts: how many experts the hash table (tid2eid) covers, when known (its max id + 1); a hash-routed
    layer with more experts than that leaves experts no token can reach."""
    if d.hc_mult < 1:
        raise ValueError(f"deepseek_v4: hc_mult {d.hc_mult} gives no residual streams; set hc_mult >= 1 (4 in V4)")
    for kind, rate in (('compressed_sparse_attention', d.csa_rate), ('heavily_compressed_attention', d.hca_rate)):
        if kind in d.layer_types and (rate < 1 or seq_len % rate):
            raise ValueError(f"deepseek_v4: compress rate {rate} of {kind} does not divide the sequence length "
                             f"{seq_len}; make max_target_length a multiple of {rate}")
    if d.rope_dim % 2 or d.rope_dim > min(d.head_dim, d.index_head_dim):
        raise ValueError(f"deepseek_v4: RoPE width {d.rope_dim} must be even and fit head_dim {d.head_dim} and "
                         f"index_head_dim {d.index_head_dim}; lower partial_rotary_factor")
    if (d.num_heads * d.head_dim) % d.o_groups:
        raise ValueError(f"deepseek_v4: o_groups {d.o_groups} does not divide num_heads*head_dim "
                         f"{d.num_heads * d.head_dim}; pick a divisor")
    if 'hash_moe' in d.mlp_layer_types and hash_table_experts is not None and d.n_experts > hash_table_experts:
        raise ValueError(f"deepseek_v4: a hash-routed layer has {d.n_experts} experts but the hash covers only "
                         f"{hash_table_experts}; use n_routed_experts <= {hash_table_experts} or a wider tid2eid")


ATTENTION_KINDS = ('sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention')


def default_layer_types(num_layers: int) -> list[str]:
    """transformers' default schedule: two HCA layers, then HCA and CSA alternating."""
    rest = ['compressed_sparse_attention' if i % 2 else 'heavily_compressed_attention' for i in range(max(num_layers - 2, 0))]
    return (['heavily_compressed_attention'] * min(num_layers, 2) + rest)[:num_layers]


def attention_schedule(v) -> list[str]:
    """Each layer's attention from model keys (v: a mapping or an attribute view)."""
    get = v.get if isinstance(v, dict) else (lambda k: getattr(v, k))
    return list(get('compress_layer_types')) or default_layer_types(get('base_num_decoder_layers'))


def dims_from_keys(v) -> Dims:
    """The sizes from maxtrain's model keys (v: the resolved config values, a dict, or the config's attribute view)."""
    get = v.get if isinstance(v, dict) else (lambda k: getattr(v, k))
    n, head_dim = get('base_num_decoder_layers'), get('head_dim')
    return Dims(
        hidden_size=get('base_emb_dim'), num_heads=get('base_num_query_heads'), head_dim=head_dim,
        rope_dim=int(head_dim * get('partial_rotary_factor')), q_lora_rank=get('q_lora_rank'),
        o_groups=get('o_groups'), o_lora_rank=get('o_lora_rank'), sliding_window=get('sliding_window_size'),
        rms_eps=get('normalization_layer_epsilon'), rope_theta=float(get('rope_max_timescale')),
        compress_rope_theta=float(get('compress_rope_theta')), csa_rate=get('compress_rate_csa'),
        hca_rate=get('compress_rate_hca'), index_n_heads=get('index_n_heads'), index_head_dim=get('index_head_dim'),
        index_topk=get('index_topk'), hc_mult=get('hc_mult'), hc_iters=get('hc_sinkhorn_iters'),
        hc_eps=float(get('hc_eps')), n_experts=get('num_experts'), top_k=get('num_experts_per_tok'),
        routed_scaling=float(get('routed_scaling_factor')), swiglu_limit=float(get('mlp_activations_limit')),
        moe_intermediate=get('base_moe_mlp_dim'), vocab_size=get('vocab_size'),
        layer_types=tuple(attention_schedule(v)),
        mlp_layer_types=tuple('hash_moe' if i < get('num_hash_layers') else 'moe' for i in range(n)),
        compress_rope_type=get('rope_type'), compress_rope_factor=float(get('rope_factor')),
        compress_rope_original_max=int(get('original_max_position_embeddings')),
        compress_rope_beta_fast=float(get('rope_beta_fast')), compress_rope_beta_slow=float(get('rope_beta_slow')))


def check_config(v: dict) -> None:
    """The resolved config's checks for decoder_block=deepseek_v4 (config/checks.py runs it before anything
    compiles): the schedule and the settings the layers need, then `check` at max_target_length."""
    n = v['base_num_decoder_layers']
    types = list(v['compress_layer_types'])
    if types and (len(types) != n or any(t not in ATTENTION_KINDS for t in types)):
        raise ValueError(f"deepseek_v4: compress_layer_types must list one of {', '.join(ATTENTION_KINDS)} for each of "
                         f"the {n} layers (got {types}); or [] for the default schedule")
    if v['sliding_window_size'] < 1:
        raise ValueError("deepseek_v4: every layer attends over a sliding window; set sliding_window_size >= 1 "
                         "(DeepSeek-V4: 128)")
    if v['q_lora_rank'] < 1 or v['index_n_heads'] < 1:
        raise ValueError(f"deepseek_v4: q_lora_rank={v['q_lora_rank']} and index_n_heads={v['index_n_heads']} must "
                         "be >= 1 (low-rank queries; the CSA layers' indexer)")
    if v['base_moe_mlp_dim'] < 1:
        raise ValueError("deepseek_v4: set base_moe_mlp_dim, the experts' (and the shared expert's) width")
    if v['num_experts_per_tok'] > v['num_experts']:
        raise ValueError(f"deepseek_v4: num_experts_per_tok={v['num_experts_per_tok']} exceeds num_experts="
                         f"{v['num_experts']}; lower it")
    if v['rope_type'] not in ('default', 'yarn'):
        raise ValueError(f"deepseek_v4: rope_type={v['rope_type']} is not implemented for its compressed layers; use "
                         "default or yarn (the released DeepSeek-V4: yarn, rope_factor=16, "
                         "original_max_position_embeddings=65536)")
    if v['rope_type'] == 'yarn' and v['rope_attention_factor'] not in (-1.0, 1.0):
        raise ValueError(f"deepseek_v4: rope_attention_factor={v['rope_attention_factor']} would scale cos and sin, "
                         "which DeepSeek-V4's reference does not; set 1.0, or leave the default -1 (deepseek_v4 reads it as 1.0)")
    if v['rope_type'] == 'yarn' and not v['rope_truncate']:
        raise ValueError("deepseek_v4: rope_truncate=false is not what DeepSeek-V4's YaRN computes (transformers "
                         "rounds its correction band); leave rope_truncate=true")
    check(dims_from_keys(v), v['max_target_length'])

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


def _rope_type(rp, label):
    sub = (rp or {}).get(label) or {}
    return sub.get('rope_type', sub.get('type', 'default'))


def dims_from_hf(c) -> Dims:
    """The sizes as transformers reads them (c: a DeepseekV4Config, after its __post_init__ folded the legacy keys)."""
    for label in ('main', 'compress'):
        kind = _rope_type(c.rope_parameters, label)
        if kind != 'default':
            raise ValueError(f"deepseek_v4: rope_parameters['{label}'] rope_type {kind!r} is not supported here; "
                             "only 'default' RoPE (no YaRN) is implemented")
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
        mlp_layer_types=tuple(c.mlp_layer_types))


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

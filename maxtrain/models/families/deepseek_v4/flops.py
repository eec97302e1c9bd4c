"""DeepSeek-V4's training FLOPs per token over a sequence of length T: 3 x (2 x the multiply-adds a token does),
counting what the forward really computes.

    weights   q_a, q_b, kv, o_a (each group: H Dh / g -> o_lora), o_b; the compressor's kv and gate (CSA: 2 Dh wide)
              and the indexer's (kv, gate 2 E wide, q_b, weights_proj); two hyper-connections a layer
              (N D x (2 + N) N) and the hyper head (N D x N); the router (D x E), k routed + 1 shared clamped
              SwiGLU expert (3 D I each); the LM head (D x V)
    attention per head 2 Dh (scores and values) for each key a query reads: the sliding keys min(t + 1, window),
              HCA's closed entries (t + 1) // m, CSA's min(index_topk, (t + 1) // m) picks; the indexer scores
              every closed CSA entry with E per indexer head
averaged over t = 0 .. T-1 (a causal sequence). Not counted: norms, softmaxes, RoPE, the compressors' pooling."""

from __future__ import annotations


def _mean(f, seq_len):
    return sum(f(t) for t in range(seq_len)) / seq_len


def flops_per_token(d, seq_len: int, dense: bool = False) -> float:
    """d: dims.Dims; seq_len: the training sequence length T. dense: count what this reference form computes, every
    query against all T keys and all T // m entries (the window, causality and top-k applied as masks after)."""
    hd = d.num_heads * d.head_dim
    attn_w = (d.hidden_size * d.q_lora_rank + d.q_lora_rank * hd + d.hidden_size * d.head_dim
              + hd * d.o_lora_rank + d.o_groups * d.o_lora_rank * d.hidden_size)
    n = d.hc_mult
    hc = 2 * n * d.hidden_size * (2 + n) * n
    mlp = d.hidden_size * d.n_experts + (d.top_k + 1) * 3 * d.hidden_size * d.moe_intermediate
    per_key = 2 * d.num_heads * d.head_dim
    if dense:
        seen = lambda t, m=1: seq_len // m  # noqa: E731
        picked = lambda t: seq_len // d.csa_rate  # noqa: E731
    else:
        seen = lambda t, m=1: (t + 1) // m  # noqa: E731
        picked = lambda t: min(d.index_topk, (t + 1) // d.csa_rate)  # noqa: E731
    sliding = _mean(lambda t: seq_len if dense else min(t + 1, d.sliding_window), seq_len) * per_key
    macs = 0.0
    for kind in d.layer_types:
        macs += attn_w + hc + mlp + sliding
        if kind == 'heavily_compressed_attention':
            macs += 2 * d.hidden_size * d.head_dim
            macs += _mean(lambda t: seen(t, d.hca_rate), seq_len) * per_key
        elif kind == 'compressed_sparse_attention':
            ie, ih = d.index_head_dim, d.index_n_heads
            macs += 2 * d.hidden_size * 2 * d.head_dim
            macs += 2 * d.hidden_size * 2 * ie + d.q_lora_rank * ih * ie + d.hidden_size * ih
            macs += _mean(picked, seq_len) * per_key
            macs += _mean(lambda t: seen(t, d.csa_rate), seq_len) * ih * ie
    macs += n * d.hidden_size * n + d.hidden_size * d.vocab_size
    return 3.0 * 2.0 * macs

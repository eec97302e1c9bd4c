"""Context parallelism's config rules (parallel/context.py, models/attention/context_parallel.py): the sequence's
chunks, the strategies' limits (pipeline stages, heads that split over the group), and the gated delta-net's
chunks. Each is a function of the resolved values that raises ConfigError naming the fix; checks.CHECKS runs
CHECKS, and checks._gated_deltanet runs gated_deltanet_chunks for the families that have those layers."""

from __future__ import annotations

from maxtrain.config import features
from maxtrain.config.schema import ways
from maxtrain.errors import ConfigError


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def _context_chunks_divide_length(v):
    """Context parallelism cuts each sequence into 2 chunks per device (dual_chunk_swap: one early, one late) or
    deals its tokens round-robin (striped: T / C each)."""
    cp, length = ways(v, "context"), v["max_target_length"]
    if not cp or cp == 1:
        return
    if v["context_parallel_reorder_strategy"] == "striped":
        _require(length % cp == 0,
                 f"context parallelism {cp} with context_parallel_reorder_strategy=striped deals each sequence's "
                 f"tokens round-robin to {cp} devices, so max_target_length={length} must be a multiple of {cp}; e.g. "
                 f"max_target_length={max(cp, length // cp * cp)}")
        return
    _require(length % (2 * cp) == 0,
             f"context parallelism {cp} (ici_context_parallelism x dcn_context_parallelism) splits each sequence "
             f"into {2 * cp} chunks (two per device, one early and one late, so that causal attention's work is "
             f"even), so max_target_length={length} must be a multiple of {2 * cp}; e.g. max_target_length="
             f"{max(2 * cp, length // (2 * cp) * 2 * cp)}")


def _ring_attention_without_pipeline_stages(v):
    """Ring and ulysses attention run their own shard_map over the context axis, not yet inside a pipeline stage's."""
    cp, stages, strategy = ways(v, "context"), ways(v, "stage"), v["context_parallel_strategy"]
    _require(not (strategy != "all_gather" and cp not in (1, None) and stages not in (1, None)),
             f"context_parallel_strategy={strategy} does not run with pipeline parallelism yet; set "
             "context_parallel_strategy=all_gather, or ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    # all_gather with the flash kernel runs a shard_map of its own too (context_parallel.all_gather_flash)
    _require(not (strategy == "all_gather" and v["attention"] == "flash" and cp not in (1, None)
                  and stages not in (1, None)),
             "attention=flash with context_parallelism (all_gather) does not run with pipeline parallelism yet; set "
             "attention=dot_product or autoselected (the plain-jnp form), or ici_pipeline_parallelism=1 and "
             "dcn_pipeline_parallelism=1")


def _split_heads(v) -> dict[str, int]:
    """The head counts an all-to-all over heads splits (ulysses, usp): query heads, kv heads (not for MLA, whose
    keys are per query head) and Gemma 4's global kv heads where set."""
    heads = {"base_num_query_heads": v["base_num_query_heads"]}
    if v["decoder_block"] not in features.MLA_FAMILIES:
        heads["base_num_kv_heads"] = v["base_num_kv_heads"]
    if v["global_num_kv_heads"] > 0:
        heads["global_num_kv_heads"] = v["global_num_kv_heads"]
    return heads


def _ulysses_heads_divide(v):
    """Ulysses attention splits each tensor-parallel shard's query and kv heads over the context group."""
    cp, tp = ways(v, "context"), v["ici_tensor_parallelism"] * v["dcn_tensor_parallelism"]
    if v["context_parallel_strategy"] != "ulysses" or cp in (1, None):
        return
    for key, n in _split_heads(v).items():
        per_shard = f" / tensor parallelism {tp} = {n // tp}" if tp > 1 else ""
        _require((n // tp) % cp == 0,
                 f"context_parallel_strategy=ulysses splits the heads over the context group, but {key}={n}"
                 f"{per_shard} is not a multiple of context parallelism {cp}; use context_parallel_strategy=ring "
                 f"(or all_gather), or a context parallelism that divides {n // tp}")


def _usp_applies(v):
    """usp needs both context levels (> 1 each) and the heads of each tensor-parallel shard to split over the ici
    context devices."""
    if v["context_parallel_strategy"] != "usp" or ways(v, "context") == 1:  # without CP: config/features.py's
        return
    ici, dcn = v["ici_context_parallelism"], v["dcn_context_parallelism"]
    _require(ici > 1 and dcn > 1,
             f"context_parallel_strategy=usp runs ulysses over ici_context_parallelism and the ring over "
             f"dcn_context_parallelism, so both must be set > 1, but they are {ici} and {dcn}; with one context level "
             "use context_parallel_strategy=ring or ulysses")
    tp = v["ici_tensor_parallelism"] * v["dcn_tensor_parallelism"]
    for key, n in _split_heads(v).items():
        per_shard = f" / tensor parallelism {tp} = {n // tp}" if tp > 1 else ""
        _require((n // tp) % ici == 0,
                 f"context_parallel_strategy=usp splits the heads over the ici context devices of a slice, but "
                 f"{key}={n}{per_shard} is not a multiple of ici_context_parallelism={ici}; use "
                 f"context_parallel_strategy=ring (or all_gather), or an ici_context_parallelism that divides {n // tp}")


def sparse_attention_message(strategy: str, cp: int, latent: int) -> str:
    """The refusal of a context strategy other than all_gather for DeepSeek Sparse Attention (the runtime's too)."""
    return (f"context_parallel_strategy={strategy} cannot split DeepSeek Sparse Attention over context parallelism "
            f"{cp}: each query's top-k keys may lie anywhere before it, which a ring or an all-to-all over heads does "
            f"not hand it; set context_parallel_strategy=all_gather (it gathers MLA's latent, {latent} numbers a "
            "token, and the indexer's keys)")


def _sparse_attention_gathers(v):
    """DeepSeek Sparse Attention (index_n_heads > 0) where its indexer runs (beyond index_topk tokens, or trained)
    splits over the context group by all_gather alone (models/families/deepseek/selected_context.py). (Pipeline
    stages, where its shard_map would nest, are refused for the family's experts before this.)"""
    cp = ways(v, "context")
    if cp in (1, None) or not features.family(v).sparse_attention or v.get("index_n_heads", 0) == 0:
        return
    if v["max_target_length"] <= v["index_topk"] and v["indexer_training"] == "none":
        return  # every query keeps every key it sees: MLA, which every strategy serves
    strategy = v["context_parallel_strategy"]
    latent = v["kv_lora_rank"] + v["qk_rope_head_dim"]
    _require(strategy == "all_gather", sparse_attention_message(strategy, cp, latent))


def _compressed_attention_gathers(v):
    """DeepSeek-V4's compressors pool whole windows of each document and its indexer picks entries anywhere before
    a query: it splits over the context group by all_gather alone (models/families/deepseek_v4/compressed_context.py)."""
    cp, strategy = ways(v, "context"), v["context_parallel_strategy"]
    if cp in (1, None) or v["decoder_block"] != "deepseek_v4":
        return
    _require(strategy == "all_gather",
             f"context_parallel_strategy={strategy} cannot split DeepSeek-V4's attention over context parallelism "
             f"{cp}: its compressors pool whole windows and its indexer picks entries anywhere before a query, which "
             "a ring or an all-to-all over heads does not hand it; set context_parallel_strategy=all_gather (it "
             f"gathers each layer's input, hidden_size={v['base_emb_dim']} numbers a token)")


def gated_deltanet_chunks(v):
    """Context parallelism hands the gated delta-net's state and convolution window from chunk to chunk of
    dual_chunk_swap (models/recurrent/context_parallel.py): runs of consecutive tokens, each at least a rule chunk."""
    cp = ways(v, "context")
    if cp in (1, None):
        return
    _require(v["context_parallel_reorder_strategy"] == "dual_chunk_swap",
             f"context_parallel_reorder_strategy={v['context_parallel_reorder_strategy']} deals the tokens "
             f"round-robin, but decoder_block={v['decoder_block']}'s gated delta-net layers run their recurrence "
             "over runs of consecutive tokens; set context_parallel_reorder_strategy=dual_chunk_swap")
    piece, least = v["max_target_length"] // (2 * cp), max(v["gdn_chunk_size"], v["gdn_conv_kernel_dim"] - 1)
    _require(piece >= least,
             f"context parallelism {cp} cuts max_target_length={v['max_target_length']} into {2 * cp} chunks of "
             f"{piece} tokens, but the gated delta-net needs chunks of at least {least} (gdn_chunk_size, and "
             "gdn_conv_kernel_dim - 1 for the convolution's window); raise max_target_length, lower "
             "gdn_chunk_size or the context parallelism")


# DeepSeek-V4's rule before the heads' (ulysses' fix, another strategy, would not serve it)
CHECKS = (_context_chunks_divide_length, _ring_attention_without_pipeline_stages, _compressed_attention_gathers,
          _usp_applies, _ulysses_heads_divide, _sparse_attention_gathers)

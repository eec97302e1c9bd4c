"""Pallas kernels: flash attention (GPU, Triton; runs on CPU in interpret mode), splash attention (TPU,
Mosaic), DeepSeek-V3.2's selected-key attention (GPU Triton and TPU Mosaic; interpret mode on CPU), the grouped GEMM
of dropless MoE (GPU, Triton; interpret mode on CPU) and the chunked gated delta rule (GPU Triton and TPU Mosaic;
interpret mode on CPU).

    flash_attention.py   forward and backward kernels with GQA, segment ids, causal and sliding-window
                         masks, logit soft-capping; checked against models/attention/'s jnp reference
    flash_tiles.py       block sizes that fit a GPU's shared memory (config/chips.py's, per compute capability)
    splash_attention.py  JAX's splash kernel behind the same signature
    tokamax_attention.py tokamax's Mosaic GPU flash attention (the optional [gpu] extra) behind the same
                         signature; tokamax is imported when first traced, never on a run that does not use it
    grouped_matmul.py    rows sorted by expert times each expert's weights, only the routed rows, with a
                         custom VJP (both gradients grouped); checked against jax.lax.ragged_dot
    gated_delta.py       the chunked gated delta rule (Qwen3-Next, Qwen3.5), one fused kernel per (batch, head)
                         sweeping the chunks, the state on chip; backward through the jnp chunked form;
                         checked against models/recurrent/gated_delta.py
    selected_attention.py DeepSeek-V3.2's attention over each query's chosen latent keys (MLA absorbed), forward
                         and backward (GPU Triton; interpret mode on CPU); checked against
                         models/families/deepseek/selected.py
    selected_attention_tpu.py the same in Mosaic (TPUs): each chosen key's row copied from HBM by a DMA of its
                         own, double-buffered; forward, dq and rows kernels; the same reference

Called only from the model: maxtrain/models/attention/ (inside shard_map), models/moe/expert_matmuls.py,
models/recurrent/gated_deltanet.py and models/families/deepseek/selected.py (inside shard_map).
Imports nothing else of maxtrain but the chip records (config/chips.py).
"""

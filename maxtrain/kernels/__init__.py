"""Pallas attention kernels: flash attention (GPU, Triton; runs on CPU in interpret mode) and splash
attention (TPU, Mosaic).

    flash_attention.py   forward and backward kernels with GQA, segment ids, causal and sliding-window
                         masks, logit soft-capping; checked against models/attention.py's jnp reference
    flash_tiles.py       block sizes that fit a GPU's shared memory (per compute capability)
    splash_attention.py  JAX's splash kernel behind the same signature
    tokamax_attention.py tokamax's Mosaic GPU flash attention (the optional [gpu] extra) behind the same
                         signature; tokamax is imported when first traced, never on a run that does not use it

Called only from maxtrain/models/attention.py (inside shard_map). Imports nothing else of maxtrain.
"""

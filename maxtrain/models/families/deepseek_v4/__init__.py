"""DeepSeek-V4 (transformers' deepseek_v4): its parts as pure JAX functions over transformers-named weights.

hyper.py (hyper-connections, Sinkhorn, the hyper head), compressed.py (HCA/CSA compressors with their RoPE, the
indexer, sliding window + compressed attention, grouped output projection), routing.py (sqrtsoftplus top-k and
hash routing, clamped SwiGLU experts), model.py (decoder layer and whole forward, no cache), dims.py (sizes from
the HF config and the checks that refuse bad inputs before compiling). Not yet a family on the contract: no
registry row, param_specs or import/export (see the branch's notes)."""

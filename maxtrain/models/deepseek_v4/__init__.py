"""DeepSeek-V4 (transformers' deepseek_v4): its parts as pure JAX functions over transformers-named weights, the
reference forms checked against transformers 5.24 (tests/models/test_deepseek_v4_parts.py).

hyper.py (hyper-connections, Sinkhorn, the hyper head), compressed.py (HCA/CSA compressors with their RoPE, the
indexer, sliding window + compressed attention with sinks, grouped output projection), routing.py (sqrtsoftplus
top-k and hash routing, clamped SwiGLU experts), model.py (decoder layer and whole forward, no cache), decode.py
(one token a step with a cache; greedy decoding), dims.py
(sizes from the HF config, and the checks that refuse bad inputs before compiling), flops.py (training FLOPs per
token counting the keys really read), checkpoint.py (save_pretrained's tensor names <-> the module names, experts
stacked and split).

Not yet a family: there is no registry row, param_specs, HF_NAMES or contract import/export, so it lives here
rather than in models/families/ (where every folder is a registered family). When the family lands, its folder
takes these modules and its MODEL wraps them."""

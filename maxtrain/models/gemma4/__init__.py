"""Gemma 4's text decoder, shared by the two families that run it: gemma4_text (transformers' Gemma4ForCausalLM)
and gemma4 (Gemma4ForConditionalGeneration: the same decoder reading images through models/vision/gemma4.py).

decoder.py (parameters, layer kinds, the layer, per-layer inputs, shared-KV state, FLOPs, Hugging Face names and
config), normed_attention.py (q/k/v-normed attention), per_layer_embed.py (per-layer input embeddings),
moe_parallel.py (the experts beside the dense MLP). It may import the shared model parts of maxtrain.models and
maxtrain.config's registry; no family imports another, so both families import these modules instead.
"""

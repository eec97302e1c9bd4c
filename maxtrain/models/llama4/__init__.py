"""Llama 4's text decoder, which two families compose (decoder_block llama4_text: the language model alone;
llama4: the same decoder reading images through models/vision/llama4.py).

    decoder.py     its layers (chunked attention, NoPE layers with attention temperature, mixture-of-experts with a
                   shared expert), parameters, FLOPs, and its Hugging Face names and config.json fields
    hf_layouts.py  its own tensor layouts (RoPE's pairs side by side; experts' fused gate_up_proj)
"""

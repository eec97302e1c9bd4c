"""Vision towers: blocks that turn pixels into embeddings which replace an image's placeholder tokens.

    qwen.py   the vision transformer of Qwen3-VL and Qwen3.5: patch embedding over space and time, learned
              positions resampled to each image's grid, 2-D rotary positions, attention within each frame,
              the 2 x 2 patch merger and Qwen3-VL's deepstack mergers; its Hugging Face names both ways
    hf_tensors.py a tower's parameters to and from transformers' tensors by its name table (every tower's)
    llama4.py Llama 4's tile encoder (class token, paired 2-D rotary), pixel-shuffle adapter and projector; HF names
    gemma4.py Gemma 4's vision encoder over padded patches with their (column, row) positions: learned per-axis
              position tables, 2-D rotary, sandwich-normed blocks with q/k/v norms and optional clipped
              linears, k x k average pooling to soft tokens, standardization, and the projector into the text
              model's width; its Hugging Face names both ways

A tower is declared like any block (models/params.py: shapes with logical axes) and run as a pure function of
(params, pixels, layout, config): what depends only on the images' grid (positions, interpolation taps, the
attention segments) is computed on the host with numpy as a layout of arrays (Qwen's patch_layout; Gemma 4's is the
processor's position array; Llama 4's tiles have one shape), padded: one compile for every batch. The families that
read images (models/families/qwen3_vl/, llama4/) run their tower through their contract.Vision.
May import the rest of models/, parallel, config and errors; never training, checkpointing, data or the commands.
"""

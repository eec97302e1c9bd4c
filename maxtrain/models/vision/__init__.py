"""Vision towers: blocks that turn pixels into embeddings which replace an image's placeholder tokens.

    qwen.py   the vision transformer of Qwen3-VL and Qwen3.5: patch embedding over space and time, learned
              positions resampled to each image's grid, 2-D rotary positions, attention within each frame,
              the 2 x 2 patch merger and Qwen3-VL's deepstack mergers; its Hugging Face names both ways

A tower is declared like any block (models/params.py: shapes with logical axes) and run as a pure function of
(params, pixels, layout, config); what depends only on the images' grid (positions, interpolation taps, the
attention segments) is computed on the host with numpy as a layout of arrays (padded: one compile for every batch).
The family that reads images (models/families/qwen3_vl/) runs it through its contract.Vision.
May import the rest of models/, parallel, config and errors; never training, checkpointing, data or the commands.
"""

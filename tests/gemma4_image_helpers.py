"""A tiny Gemma 4 with its image tower and a generated image-conversation dataset for it (the boi, image and eoi
tokens as single pieces; images padded to 70 soft tokens of 2 x 2 pooled 4-pixel patches: 280 patches each), for
tests/data/test_gemma4_image_conversations.py. The model keys come from the family's own reading of a Gemma4Config
dict (from_hf_config), so no torch is needed."""

from __future__ import annotations

import image_chat_helpers as helpers

SYMBOLS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")  # boi, image, eoi
PROCESSOR = {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}
BLOCK = 70 * 2 * 2  # the patches each image takes
TEXT = dict(model_type="gemma4_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, vocab_size=320, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0)
VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=24)


def ids(tokenizer: str) -> tuple[int, int, int]:
    """(boi, image, eoi) token ids of the dataset's tokenizer."""
    return tuple(helpers.image_token_id(tokenizer, s) for s in SYMBOLS)


def make_dataset(directory: str, n: int = 12) -> dict:
    return helpers.make_dataset(directory, n, SYMBOLS, PROCESSOR)


def model_args(paths: dict) -> list[str]:
    """The tiny gemma4 SFT run's keys (on top of conftest.TINY)."""
    import json  # pylint: disable=import-outside-toplevel

    from maxtrain.models.families import gemma4  # pylint: disable=import-outside-toplevel

    boi, image, eoi = ids(paths["tokenizer"])
    keys = gemma4.from_hf_config({"text_config": TEXT, "vision_config": VISION, "image_token_id": image,
                                  "boi_token_id": boi, "eoi_token_id": eoi})
    return (["decoder_block=gemma4"]
            + [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in keys.items()]
            + [f"image_patches_per_row={BLOCK}", "dataset_type=jsonl", f"grain_train_files={paths['train']}",
               f"tokenizer_path={paths['tokenizer']}", "objective=sft", "train_data_columns=[messages]",
               "chat_template=chatml", "max_target_length=96", "eval_interval=-1"])

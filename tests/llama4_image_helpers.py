"""A tiny Llama 4 with its tile tower and a generated image-conversation dataset for it, for
tests/data/test_llama4_image_conversations.py and tests/models/test_decode_image_llama4.py: a character-level
Hugging Face tokenizer (tokenizer.json) with Llama 4's special tokens and a chat template written as Llama 4's is
for text and image items, beside preprocessor_config.json (tiles of 16 pixels, at most 4 an image); the tower cuts a
tile into 4 x 4 patches of 4, shuffled 2 x 2 into 4 tokens. The model keys come from the family's own reading of a
Llama4Config dict (from_hf_config), so no torch is needed."""

from __future__ import annotations

import json
import os

import image_chat_helpers as helpers

SYMBOLS = ("<|image_start|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
           "<|image_end|>")
SPECIAL = ("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>") + SYMBOLS
# Llama 4's chat template, for messages without tools or a system turn
TEMPLATE = ("{{- bos_token }}{%- for message in messages %}{{- '<|header_start|>' + message['role'] + "
            "'<|header_end|>\\n\\n' }}{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
            "{%- for content in message['content'] %}{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
            "{%- elif content['type'] == 'text' %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
            "{{- '<|eot|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|header_start|>assistant"
            "<|header_end|>\\n\\n' }}{%- endif %}")
PROCESSOR = {"size": {"height": 16, "width": 16}, "max_patches": 4, "resize_to_max_canvas": False}
TILE = 16            # the patches of a tile (4 x 4)
PER_TILE = 4         # the <|patch|> tokens of a tile
TEXT = dict(hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=128, num_local_experts=2, num_experts_per_tok=1,
            interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=16, floor_scale=4,
            attn_scale=0.3, max_position_embeddings=256)
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=16,
              patch_size=4, pixel_shuffle_ratio=0.5, projector_input_dim=16, projector_output_dim=16,
              vision_output_dim=16, num_channels=3)
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,?!'"


def write_tokenizer(directory: str) -> str:
    """tokenizer.json (a character per token, Llama 4's special tokens whole) and tokenizer_config.json."""
    import tokenizers  # pylint: disable=import-outside-toplevel

    vocab = {t: i for i, t in enumerate(SPECIAL + ("[UNK]",) + tuple(CHARS))}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL))
    os.makedirs(directory, exist_ok=True)
    backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "unk_token": "[UNK]",
                   "chat_template": TEMPLATE}, f)
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    return directory


def make_dataset(directory: str, n: int = 12) -> dict:
    """train.jsonl (n records of one coloured image each, 16x24 or 24x16 pixels) and the tokenizer directory."""
    convs = helpers.conversations(directory, n)
    return {"train": helpers.write_jsonl(os.path.join(directory, "train.jsonl"), convs), "dir": directory,
            "tokenizer": write_tokenizer(os.path.join(directory, "tokenizer")), "records": convs}


def ids() -> dict:
    """{piece: id} of the image pieces."""
    return {s: SPECIAL.index(s) for s in SYMBOLS}


def model_keys() -> dict:
    from maxtrain.models.families import llama4  # pylint: disable=import-outside-toplevel

    return llama4.from_hf_config({"text_config": TEXT, "vision_config": VISION,
                                  "image_token_index": ids()["<|patch|>"]})


def model_args(paths: dict, patches_per_row: int = 5 * TILE) -> list[str]:
    """The tiny llama4 SFT run's keys (on top of conftest.TINY): by default a row holds one image of 4 tiles and its
    global view."""
    return (["decoder_block=llama4"]
            + [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in model_keys().items()]
            + [f"image_patches_per_row={patches_per_row}", "dataset_type=jsonl", f"grain_train_files={paths['train']}",
               f"tokenizer_path={paths['tokenizer']}", "objective=sft", "train_data_columns=[messages]",
               "max_target_length=96", "eval_interval=-1"])

"""Small generated image conversations (coloured squares: "what colour?"), a sentencepiece tokenizer with the image
tokens as single pieces, and a tiny qwen3_vl model's keys, for tests/data/test_image_conversations.py."""

from __future__ import annotations

import json
import os
import random

import numpy as np

from post_helpers import train_tokenizer

IMAGE_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16, in_channels=3,
              deepstack_visual_indexes=[0], model_type="qwen3_vl")
PROCESSOR = {"min_pixels": 64, "max_pixels": 1024, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def write_png(path: str, size: tuple[int, int], colour) -> None:
    from PIL import Image  # pylint: disable=import-outside-toplevel

    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def conversations(directory: str, n: int, seed: int = 0) -> list[dict]:
    """n records, each one image of 16x24 or 24x16 pixels (6 placeholders) in images/, paths relative."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name = rng.choice(sorted(COLOURS))
        rel = f"images/{seed}_{i:04d}.png"
        write_png(os.path.join(directory, rel), rng.choice([(16, 24), (24, 16)]), COLOURS[name])
        out.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": rel}, {"type": "text", "text": "colour?"}]},
            {"role": "assistant", "content": name}]})
    return out


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def make_dataset(directory: str, n: int = 24, symbols=tuple(IMAGE_TOKENS), processor=None) -> dict:
    """train.jsonl (n records), tok.model (with `symbols` as single pieces) with preprocessor_config.json beside
    it."""
    convs = conversations(directory, n)
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content'] if isinstance(m['content'], str) else 'colour?'}"
                     "<|im_end|>\n" for m in c["messages"]) for c in convs] * 5
    tok = train_tokenizer(os.path.join(directory, "tok.model"), texts + ["red green blue colour"] * 5)
    _add_symbols(tok, symbols)
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR if processor is None else processor, f)
    return {"train": write_jsonl(os.path.join(directory, "train.jsonl"), convs), "tokenizer": tok,
            "dir": directory, "records": convs}


def _add_symbols(path: str, symbols=tuple(IMAGE_TOKENS)) -> None:
    """The image tokens added to the sentencepiece model as user-defined pieces (single tokens)."""
    from sentencepiece import sentencepiece_model_pb2 as pb  # pylint: disable=import-outside-toplevel

    model = pb.ModelProto()
    with open(path, "rb") as f:
        model.ParseFromString(f.read())
    for symbol in symbols:
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = symbol, 0.0, pb.ModelProto.SentencePiece.USER_DEFINED
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def image_token_id(path: str, piece: str = "<|image_pad|>") -> int:
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    return spm.SentencePieceProcessor(model_file=path).piece_to_id(piece)


def model_args(paths: dict) -> list[str]:
    """The tiny qwen3_vl SFT run's keys (on top of conftest.TINY)."""
    return ["decoder_block=qwen3_vl", f"vision_config={json.dumps(VISION)}", "mrope_section=[2,3,3]",
            f"image_token_id={image_token_id(paths['tokenizer'])}", "image_patches_per_row=64", "dataset_type=jsonl",
            f"grain_train_files={paths['train']}", f"tokenizer_path={paths['tokenizer']}", "objective=sft",
            "train_data_columns=[messages]", "chat_template=chatml", "vocab_size=320", "max_target_length=48",
            "eval_interval=-1"]


def pixels_equal(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))

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


# --------------------------------------------------------------------------------------------
# Rows split over hosts (the per-row image layout, data/image_layout.py)
# --------------------------------------------------------------------------------------------


def raw_rows(config, convert, records: list[dict], where: str, num_rows: int) -> dict:
    """A host batch [1, num_rows, ...] of packed rows before the image layout (as the pipeline hands it to
    ToModelImages): `records` converted by `convert` (conversations.converter) and packed first-fit."""
    import grain  # pylint: disable=import-outside-toplevel

    from maxtrain.data import conversations, image_conversations  # pylint: disable=import-outside-toplevel

    elements = grain.MapDataset.source([convert((f"{where} line {i + 1}", r)) for i, r in enumerate(records)])
    rows = list(image_conversations.rows(elements.to_iter_dataset(), config, num_rows, conversations.to_example))
    assert len(rows) >= num_rows, f"{len(records)} records packed into {len(rows)} rows, fewer than {num_rows}"
    return {k: np.stack([row[k] for row in rows[:num_rows]])[None] for k in rows[0]}


def halves(finish, raw: dict) -> dict:
    """The model's batch made as two hosts would: each finishing its half of the rows, the halves concatenated."""
    b = raw["inputs"].shape[1]
    parts = [finish({k: v[:, lo:hi] for k, v in raw.items()}) for lo, hi in ((0, b // 2), (b // 2, b))]
    return {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}


def flat_layout(finish, raw: dict) -> dict:
    """The layout before rows had their own slots (the control): the micro batch's images in one list, padded after
    the last row's, cut into b equal parts per key."""
    from maxtrain.data import image_conversations, image_layout  # pylint: disable=import-outside-toplevel

    out = {}
    inputs, grids = raw["inputs"][0], raw[image_conversations.GRIDS][0]
    b = inputs.shape[0]
    real = [g[g.any(axis=1)] for g in grids]
    arrays = {k: np.concatenate([raw[k][0][r][:int(real[r].prod(axis=1).sum())] for r in range(b)])
              for k in finish.patch_shapes}
    _, images = image_layout.model_inputs(finish.vision, finish.config, finish.tower, inputs, arrays,
                                          np.concatenate(real), pad_to=b * finish.patches)
    for k, v in images.items():
        v = np.asarray(v)
        out[image_conversations.ROWS + k] = v.reshape((1, b, v.shape[0] // b) + v.shape[1:])
    return out


def rows_alone(finish, raw: dict):
    """The flat images of each row of `raw` ([1, b, ...]) alone, made by Vision.inputs for that row's tokens [1, T]
    (unpadded)."""
    from maxtrain.data import image_conversations, image_layout  # pylint: disable=import-outside-toplevel

    for r in range(raw["inputs"].shape[1]):
        grids = raw[image_conversations.GRIDS][0][r]
        real = grids[grids.any(axis=1)]
        patches = int(real.prod(axis=1).sum())
        _, images = image_layout.model_inputs(finish.vision, finish.config, finish.tower, raw["inputs"][0][r:r + 1],
                                              {k: raw[k][0][r][:patches] for k in finish.patch_shapes}, real)
        yield images


_FORWARDS: dict = {}  # (id(model), id(rt)) -> (model, rt, the jitted forward): one trace per shape, not per call


def forward(model, params, rt, inputs, positions, segment_ids, images: dict, jit: bool = True):
    """Logits [B, T, V] of the model on images by row or flat, at the highest matmul precision (jitted: op-by-op
    the tiny model's forwards took most of these tests' time; `jit=False` where each call has its own shapes)."""
    import jax  # pylint: disable=import-outside-toplevel  # deferred: the data-only tests never start jax

    if not jit:
        with jax.default_matmul_precision("highest"):
            return np.asarray(model.forward(params, inputs, positions, segment_ids, rt, images=images)[0])
    key = (id(model), id(rt))
    entry = _FORWARDS.get(key)
    if entry is None or entry[0] is not model or entry[1] is not rt:
        entry = _FORWARDS[key] = (model, rt, jax.jit(
            lambda p, i, pos, s, im: model.forward(p, i, pos, s, rt, images=im)[0]))
    with jax.default_matmul_precision("highest"):
        return np.asarray(entry[2](params, inputs, positions, segment_ids, images))


def check_rows_split_over_hosts(model, params, rt, finish, raw: dict) -> bool:
    """Two hosts each making half the rows give the model's inputs of one host making them all, and its logits on
    them are each row's alone; the flat layout (the control) interleaves host 0's padding, so its inputs differ.
    Returns whether the flat model's logits on the two hosts' flat layouts differ from some row's alone."""
    from maxtrain.models import image_batch  # pylint: disable=import-outside-toplevel

    whole, split = finish(raw), halves(finish, raw)
    assert sorted(whole) == sorted(split)
    for k in whole:
        np.testing.assert_array_equal(split[k], whole[k], err_msg=k)
    old_whole, old_split = flat_layout(finish, raw), halves(lambda part: flat_layout(finish, part), raw)
    assert any(not np.array_equal(old_whole[k], old_split[k]) for k in old_whole)  # the control
    batch = {k: v[0] for k, v in split.items()}
    positions = image_batch.positions(batch)
    logits = forward(model, params, rt, batch["inputs"], positions, batch["segment_ids"],
                     image_batch.images(model, batch))
    flat = {k: v[0].reshape((-1,) + v.shape[3:]) for k, v in old_split.items()}  # the flat model on two hosts' data
    old = forward(model, params, rt, batch["inputs"], positions, batch["segment_ids"],
                  {k[len(image_batch.ROWS):]: v for k, v in flat.items()})
    differs = []
    for r, images in enumerate(rows_alone(finish, raw)):
        seg = batch["segment_ids"][r:r + 1]
        alone = forward(model, params, rt, batch["inputs"][r:r + 1], positions[..., r:r + 1, :], seg, images)
        np.testing.assert_allclose(logits[r][seg[0] > 0], alone[0][seg[0] > 0], rtol=1e-5, atol=1e-5)
        differs.append(not np.allclose(old[r][seg[0] > 0], alone[0][seg[0] > 0], rtol=1e-5, atol=1e-5))
    return any(differs)

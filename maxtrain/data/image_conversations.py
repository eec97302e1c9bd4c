"""SFT on conversations whose user turns hold images (issue 59, item 4), for a family with an image tower: its
contract.Vision (`vision`, handed in by the command that bound the model: data/ does not import models/) lays out
positions and images; towers.for_tower preprocesses them as the tower's processor does.

Records. transformers' chat format: a message's content is a string or a list of items {"type": "text", "text": ...}
and {"type": "image", "image": ...}, the image a path relative to the data file's folder (jsonl), raw bytes, or the
Hugging Face datasets struct {"bytes": ..., "path": ...} (parquet); an image item without "image" takes the next
entry of the record's `images` column (TRL's layout).

Rendering. The tokenizer's own template sees the content lists (images as {"type": "image"}), as transformers'
apply_chat_template does; a built-in template (chatml, ...) gets each content as text, an image as the image token's
text (image_token_id's piece), items joined by newlines. The rendered ids are chat.py's (loss weights as for text
SFT); each image token is then expanded to the placeholder count the family's processor gives for that image,
weight 0 (Llama 4: each <|image|> its template writes becomes the image's whole text, as Llama4Processor writes it:
towers.TowerImages' marker and texts). Images are decoded and preprocessed in ToImageElement, a Grain map: with grain_worker_count > 0 in the
workers, never in the main process.

Elements carry tokens, weights, parts, positions [n, S] (the family's position streams, S = 3 for M-RoPE, made by
Vision.inputs for the conversation alone, so every packed conversation's positions start over), the tower's patch
arrays (pixel_values [patches, ...]; Gemma 4's also image_position_ids) and grids [images, 3]; data/image_layout.py
says how each tower's images sit (Qwen's grids; Gemma 4's fixed blocks of patches, boi and eoi around each image). First-fit packing packs the tokens into rows of max_target_length + 1 and the
patches into image_patches_per_row at once (an element goes where both fit), so an image's tokens are never split;
a truncated conversation keeps only the images wholly inside its inputs.

Batches. Vision.inputs lays out each packed row's images alone, in the row's own slot (padded to
image_patches_per_row patches, so the step compiles once); every image array is stored with a leading row axis
[b, X, ...] (named rows_<key>), positions [b, T, S], and the model gives row r's placeholders row r's image features
(models/image_batch.py). A row's arrays depend on that row alone, so the hosts of a multi-process run (each making
its own rows, data/hosts.py) and the data-parallel shards give the same inputs as one host making the whole batch.
"""

from __future__ import annotations

import io
import os
import re
import warnings

import numpy as np

from maxtrain.config import objectives
from maxtrain.data import chat, hosts, images as images_lib, towers
from maxtrain.data.image_layout import check_row_budget, cut, expand_texts, model_inputs, piece_ids
from maxtrain.data.errors import DataError

PIXELS, GRIDS = "pixel_values", "image_grids"
ROWS = "rows_"  # a batch's image arrays, stored by row: ROWS + the Vision's input key (models/image_batch.py)
TEXT_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_weights")


def vision_of(config, vision):
    """`vision` (the bound model's contract.Vision, handed in by the command that bound the model: data/ does not
    import models/), or a DataError when the model reads no images."""
    if vision is None or not getattr(config, "vision_config", ""):
        raise DataError(f"decoder_block={config.decoder_block} has no image tower"
                        + ("" if vision is None else " in this checkpoint (vision_config is empty)")
                        + ": it cannot read image conversations. Use a model with one (e.g. a Qwen3-VL checkpoint "
                        "imported with scripts/convert_hf.py import), or drop the images from the data")
    return vision


def preprocessor(config):
    """The image -> (patch arrays, grid, placeholders) map of the model's tower (towers.TowerImages)."""
    import json  # pylint: disable=import-outside-toplevel

    return towers.for_tower(json.loads(config.vision_config), processor_config(config))


def processor_config(config) -> dict | None:
    """preprocessor_config.json beside the tokenizer (the checkpoint's processor), or None."""
    import json  # pylint: disable=import-outside-toplevel

    folder = config.tokenizer_path if os.path.isdir(config.tokenizer_path or "") else \
        os.path.dirname(config.tokenizer_path or "")
    path = os.path.join(folder, "preprocessor_config.json")
    if not folder or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def has_images(record: dict, columns: list[str]) -> bool:
    """Whether a record holds an image item (or an `images` column)."""
    if record.get("images"):
        return True
    messages = record.get(columns[0]) if len(columns) == 1 else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(i, dict) and i.get("type") == "image" for i in m["content"]) for m in messages)


# --------------------------------------------------------------------------------------------
# Records -> messages and images
# --------------------------------------------------------------------------------------------


def messages_and_images(record: dict, columns: list[str], where: str, key: str):
    """(messages with content strings or lists of {type}, image sources in order), or a DataError."""
    if len(columns) != 1:
        raise DataError(f"{where}: image conversations are read from one messages column; set {key}=[messages]")
    if columns[0] not in record:
        raise DataError(f"{where}: no {columns[0]!r} field (the record has: {', '.join(map(str, record))}); name it "
                        f"with {key}=[messages]")
    messages = record[columns[0]]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    spare = list(record.get("images") or [])
    out, sources = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in chat.ROLES:
            raise DataError(f"{where}: message {i} has an unknown role {m['role']!r}; roles are "
                            f"{', '.join(chat.ROLES)}")
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, (list, tuple)):
            raise DataError(f"{where}: message {i} has content of type {type(content).__name__}; it must be a string "
                            "or a list of {type: text|image} items")
        items = []
        for item in content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text" and isinstance(item.get("text"), str):
                items.append({"type": "text", "text": item["text"]})
            elif kind == "image":
                if m["role"] == "assistant":
                    raise DataError(f"{where}: message {i} (assistant) holds an image; the model reads images, it "
                                    "does not write them: move the image to a user turn")
                source = item.get("image")
                if source is None:
                    if not spare:
                        raise DataError(f"{where}: message {i} has an image item without 'image' and the record's "
                                        "images column has no image left for it; give its path or bytes")
                    source = spare.pop(0)
                sources.append(source)
                items.append({"type": "image"})
            else:
                raise DataError(f"{where}: message {i} has an item {item!r:.80}; items are {{'type': 'text', 'text': "
                                "...} or {'type': 'image', 'image': path or bytes}")
        out.append({"role": m["role"], "content": items})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing would be learned from it. Add "
                        "the assistant's reply, or remove the record")
    return out, sources


def as_text(messages: list[dict], image_text: str) -> list[dict]:
    """Content lists as strings (for built-in templates): text items as they are, images as `image_text`."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "\n".join(
        image_text if item["type"] == "image" else item["text"] for item in m["content"])} for m in messages]


def open_image(source, folder: str, where: str, index: int, max_pixels: int):
    """A loaded Pillow image from a path (relative to `folder`), bytes, or {bytes, path}; one-line DataErrors."""
    pil = images_lib.pillow()
    data, path = None, None
    if isinstance(source, dict):
        data, path = source.get("bytes"), source.get("path")
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str):
        path = source
    if data is None and not path:
        raise DataError(f"{where}: image {index} is {type(source).__name__} {source!r:.60}; give a path (relative to "
                        "the data file), bytes, or {'bytes': ..., 'path': ...}")
    name = f"image {index}" + (f" ({path!r})" if path else "")
    if data is None:
        full = path if os.path.isabs(path) or "://" in path else os.path.join(folder, path)
        try:
            with open(full, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise DataError(f"{where}: {name} is not found (looked for {full}); paths are relative to the data "
                            "file's folder: fix the path or add the file") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pil.DecompressionBombWarning)
            image = pil.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise DataError(f"{where}: {name} is {width}x{height} pixels, over max_image_pixels={max_pixels}; "
                                "downscale it, or raise max_image_pixels")
            image.load()
    except pil.DecompressionBombError as e:
        raise DataError(f"{where}: {name} is over Pillow's size limit ({e}); downscale it") from None
    except (pil.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: {name} is not an image Pillow can read ({type(e).__name__}: {e}); re-save it as "
                        "PNG or JPEG, or remove the record") from None
    return image


# --------------------------------------------------------------------------------------------
# Elements
# --------------------------------------------------------------------------------------------


def expand(tokens, weights, image_token_id: int, counts: list[int], where: str, image_text: str, wrap: tuple = ()):
    """Each image token repeated to its image's placeholder count, weight 0; with `wrap` (begin, end), as
    begin + placeholders + end (Gemma 4's processor: boi, the soft tokens, eoi)."""
    at = np.flatnonzero(tokens == image_token_id)
    if len(at) != len(counts):
        raise DataError(f"{where}: the chat template wrote {len(at)} image tokens ({image_text!r}, id "
                        f"{image_token_id}) for {len(counts)} images; use the checkpoint's own chat template (or a "
                        "built-in one) with a tokenizer that holds the image token as one piece")
    repeat = np.ones(len(tokens), np.int64)
    repeat[at] = np.asarray(counts, np.int64) + len(wrap)
    image = np.repeat(np.isin(np.arange(len(tokens)), at), repeat)
    tokens, weights = np.repeat(tokens, repeat), np.repeat(weights, repeat)
    if wrap:
        first = np.flatnonzero(image & ~np.concatenate([[False], image[:-1]]))
        last = np.flatnonzero(image & ~np.concatenate([image[1:], [False]]))
        tokens[first], tokens[last] = wrap
    weights[image] = 0.0
    return tokens.astype(np.int32), weights.astype(np.float32)


class ToImageElement:
    """(location, record) -> a packing element with its images preprocessed (picklable: runs in Grain's workers)."""

    def __init__(self, template: chat.Template, config, columns: list[str], length: int, vision, preprocess,
                 key: str = "train_data_columns", log=print):
        self.template, self.config, self.columns, self.length = template, config, columns, length
        self.vision, self.preprocess, self.key, self.log = vision, preprocess, key, log
        self.completion_only = config.sft_train_on_completion_only
        self.image_token_id = config.image_token_id
        self.image_text = preprocess.marker or template.tokenizer.piece(config.image_token_id)
        self.ids = piece_ids(template.tokenizer, preprocess.texts, "image conversations") if preprocess.texts else {}
        if self.ids and config.image_token_id not in self.ids.values():
            raise DataError(f"image_token_id={config.image_token_id} is none of the tokenizer's image pieces {self.ids}"
                            "; set it to the id of the image placeholder token, as scripts/convert_hf.py import "
                            "writes it")
        self.marker_id = self.ids.get(preprocess.marker, config.image_token_id)
        self.bounds = (self.ids[preprocess.texts[0]], self.ids[preprocess.texts[-1]]) if self.ids else ()
        self.max_pixels, self.patches_per_row = config.max_image_pixels, config.image_patches_per_row
        self.truncated, self.passes = 0, 0

    def images(self, sources: list, where: str):
        folder = os.path.dirname(where.rsplit(" ", 2)[0])
        done = []
        for i, source in enumerate(sources):
            image = open_image(source, folder, where, i, self.max_pixels)
            try:
                done.append(self.preprocess(image))
            except DataError as e:
                raise DataError(f"{where}: image {i}: {e}") from None
        return done

    def unchanged(self, located) -> dict:
        where, record = located
        messages, sources = messages_and_images(record, self.columns, where, self.key)
        if self.template.builtin:
            messages = as_text(messages, self.image_text)
        done = self.images(sources, where)
        text_parts = chat.parts(self.template, messages, self.completion_only, where)
        tokens, weights = chat.encode_parts(self.template, text_parts)
        if self.ids:  # the whole image text in place of the template's marker (Llama 4)
            tokens, weights = expand_texts(tokens, weights, self.marker_id, [[self.ids[t] for t in d[3]] for d in done],
                                           where, self.image_text)
        else:
            tokens, weights = expand(tokens, weights, self.image_token_id, [d[2] for d in done], where,
                                     self.image_text, self.preprocess.wrap)
        if not weights.any():
            raise DataError(f"{where}: the conversation renders to no assistant tokens; check its messages")
        grids = np.asarray([d[1] for d in done], np.int32).reshape(-1, 3)
        patches = int(grids.prod(axis=1).sum())
        if patches > self.patches_per_row:
            raise DataError(f"{where}: its {len(done)} images need {patches} patches but a row holds "
                            f"image_patches_per_row={self.patches_per_row}; raise image_patches_per_row to "
                            f"{patches} or more, or give fewer or smaller images (the processor's "
                            f"{'max_patches tiles' if self.preprocess.tile else 'max_pixels'})")
        if not done:  # no image: the streams of text alone, every one counting on
            positions = np.broadcast_to(np.arange(len(tokens), dtype=np.int32)[:, None], (len(tokens), self.streams))
            arrays = {k: np.zeros((0,) + shape, dtype) for k, (shape, dtype) in self.patch_shapes.items()}
        else:
            arrays = {k: np.concatenate([d[0][k] for d in done]) for k in done[0][0]}
            try:
                positions, _ = model_inputs(self.vision, self.config, self.preprocess, tokens[None], arrays, grids)
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None
            positions = np.asarray(positions)
            positions = positions[:, 0].T if positions.ndim == 3 else positions[0][:, None]
        n = len(tokens)
        return {"tokens": tokens, "weights": weights, "parts": np.ones(n, np.int32),
                "positions": np.ascontiguousarray(positions, np.int32), **arrays, GRIDS: grids}

    def __call__(self, located) -> dict:
        element, was_cut = cut(self.unchanged(located), self.length, self.image_token_id,
                               lead=len(self.preprocess.wrap) // 2, bounds=self.bounds)
        if was_cut and self.passes <= 1:
            self.truncated += 1
            if self.truncated & (self.truncated - 1) == 0:
                self.log(f"warning: {self.truncated} conversations so far were longer than max_target_length + 1 = "
                         f"{self.length} tokens and were truncated (images past the cut dropped; e.g. "
                         f"{located[0]}); raise max_target_length to keep them whole")
        return element

    def probe(self) -> "ToImageElement":
        self.patch_shapes, self.streams = probe(self.config, self.vision, self.preprocess)
        return self


def probe(config, vision, preprocess) -> tuple[dict, int]:
    """({patch array: (the shape of one patch's row, dtype)}, the number of position streams) from one small image,
    in the main process (it also proves the processor works, and image_patches_per_row fits its layout, before
    training starts)."""
    check_row_budget(preprocess, config.image_patches_per_row)
    arrays, grid, count, _ = preprocess(images_lib.pillow().new("RGB", (32, 32)))
    positions, _ = model_inputs(vision, config, preprocess, np.full((1, count), config.image_token_id, np.int32),
                                arrays, [grid])
    return ({k: (tuple(np.shape(v)[1:]), np.asarray(v).dtype) for k, v in arrays.items()},
            (np.shape(positions)[0] if np.ndim(positions) == 3 else 1))


# --------------------------------------------------------------------------------------------
# Rows and batches
# --------------------------------------------------------------------------------------------


def to_example(row: dict, text_example, keys: tuple = (PIXELS,)) -> dict:
    """A packed row (tokens T + 1, patches, grids) -> the text example [T] (text_example: conversations.to_example;
    positions [T, S]) with the row's patch arrays `keys` (pixel_values, ...) [patches_per_row, ...] and image_grids
    [patches_per_row, 3] (rows of zeros past its images)."""
    return {**text_example(row), **{k: row[k] for k in keys}, GRIDS: row[GRIDS]}


def _single_row(element: dict, length: int, patches: int, text_example, keys: tuple) -> dict:
    n = len(element["tokens"])
    row = {}
    for k, v in element.items():
        size = patches if k in keys or k == GRIDS else length
        row[k] = np.zeros((size,) + v.shape[1:], v.dtype)
        row[k][:len(v)] = v
    row["tokens_segment_ids"] = (np.arange(length) < n).astype(np.int32)
    return to_example(row, text_example, keys)


def rows(elements, config, num_rows: int, text_example):
    """Examples of whole conversations: first-fit into `num_rows` open rows by tokens and patches at once."""
    import functools  # pylint: disable=import-outside-toplevel

    from grain import experimental as grain_exp  # pylint: disable=import-outside-toplevel

    length, patches = config.max_target_length + 1, config.image_patches_per_row
    keys = preprocessor(config).keys
    if not config.packing:
        return elements.map(functools.partial(_single_row, length=length, patches=patches, text_example=text_example,
                                              keys=keys))
    struct = {"tokens": length, "weights": length, "parts": length, "positions": length, GRIDS: patches,
              **{k: patches for k in keys}}
    packed = grain_exp.FirstFitPackIterDataset(elements, length_struct=struct, num_packing_bins=num_rows,
                                               shuffle_bins=False)
    return packed.map(functools.partial(to_example, text_example=text_example, keys=keys))


class ToModelImages:
    """A host batch [A, b, ...] of packed rows -> the model's: Vision.inputs lays out each row's images alone, in
    that row's slot (padded to image_patches_per_row patches: Gemma 4's to image_patches_per_row / M images of M
    patches), each array stored as [A, b, X, ...] (models/image_batch.py: row r's placeholders take row r's
    features); positions [A, b, T, S] (S = 1: [A, b, T]). A batch without image arrays (padding) gets padding
    images. Picklable."""

    def __init__(self, config, vision, tower, patch_shapes: dict, streams: int):
        self.config, self.vision, self.tower, self.streams = config, vision, tower, streams
        self.patch_shapes, self.patches = dict(patch_shapes), config.image_patches_per_row

    def micro(self, inputs, arrays: dict, grids) -> dict:
        """Each row's images laid out alone, in its own slot (so that any split of the rows over hosts lays them
        out alike), stacked: {ROWS + key: [b, X, ...]}."""
        laid = []
        for r in range(inputs.shape[0]):
            real = grids[r][grids[r].any(axis=1)]
            patches = int(real.prod(axis=1).sum())
            try:
                _, images = model_inputs(self.vision, self.config, self.tower, inputs[r:r + 1],
                                         {k: v[r][:patches] for k, v in arrays.items()}, real, pad_to=self.patches)
            except ValueError as e:
                raise DataError(f"row {r} of a batch: {e}") from None
            laid.append(images)
        return {ROWS + k: np.stack([np.asarray(images[k]) for images in laid]) for k in laid[0]}

    def __call__(self, batch: dict) -> dict:
        accum, b, _ = batch["inputs"].shape
        arrays = {k: batch[k] if k in batch else np.zeros((accum, b, self.patches) + shape, dtype)
                  for k, (shape, dtype) in self.patch_shapes.items()}
        grids = batch.get(GRIDS)
        if grids is None:
            grids = np.zeros((accum, b, self.patches, 3), np.int32)
        micro = [self.micro(batch["inputs"][a], {k: v[a] for k, v in arrays.items()}, grids[a]) for a in range(accum)]
        out = {k: batch[k] for k in TEXT_KEYS}
        positions = out["positions"]
        if positions.ndim == 3:
            positions = np.broadcast_to(positions[..., None], positions.shape + (self.streams,))
        out["positions"] = np.ascontiguousarray(positions[..., 0] if self.streams == 1 else positions)
        return {**out, **{k: np.stack([m[k] for m in micro]) for k in micro[0]}}


# --------------------------------------------------------------------------------------------
# Wiring (conversations.make_inputs)
# --------------------------------------------------------------------------------------------


def active(config, vision) -> bool:
    """Whether SFT records are read as image conversations: the bound model's family has an image tower (`vision`)
    and the config its vision_config."""
    return (vision is not None and bool(getattr(config, "vision_config", ""))
            and objectives.data_kind(config) != objectives.PAIRS)


def refuse(config, vision, where: str) -> None:
    """A record with images read by the text path: one line saying why and what to do."""
    if not active(config, vision):
        if objectives.data_kind(config) == objectives.PAIRS:
            raise DataError(f"{where}: the record holds images, but preference pairs are text only; train on image "
                            "conversations with objective=sft, or drop the images")
        try:
            vision_of(config, vision)
        except DataError as e:
            raise DataError(f"{where}: the record holds images, but {e}") from None


def converter(template, config, vision, columns: list[str], length: int, log, key: str) -> ToImageElement:
    """ToImageElement for the config's family (probed: its pixel shape and position streams are known)."""
    vision = vision_of(config, vision)
    if config.image_token_id < 0:
        raise DataError("image_token_id is -1: set it to the id of the image placeholder token (<|image_pad|>), as "
                        "scripts/convert_hf.py import writes it")
    return ToImageElement(template, config, columns, length, vision, preprocessor(config), key, log).probe()


def finisher(config, element: ToImageElement) -> ToModelImages:
    return ToModelImages(config, element.vision, element.preprocess, element.patch_shapes, element.streams)


class EvalImages:
    """ToModelImages for an eval batch [b, ...] (no accumulation axis). Picklable."""

    def __init__(self, finish: ToModelImages):
        self.finish = finish

    def __call__(self, batch: dict) -> dict:
        return {k: v[0] for k, v in self.finish({k: v[None] for k, v in batch.items()}).items()}


def batch_shapes(config, vision, shape: tuple) -> dict:
    """{key: (shape, dtype)} of a training batch of `shape` [A, b, T] of image conversations (the compiled step's):
    the image layout a batch without images gets, made by the code that makes the real ones."""
    vision = vision_of(config, vision)
    tower = preprocessor(config)
    patch_shapes, streams = probe(config, vision, tower)
    batch = ToModelImages(config, vision, tower, patch_shapes, streams)(hosts.padding_batch(shape[:2], shape[2]))
    return {k: (v.shape, v.dtype) for k, v in batch.items()}


# --------------------------------------------------------------------------------------------
# Showing where the images sit (inspect_data)
# --------------------------------------------------------------------------------------------


def runs_once(text: str, piece: str) -> str:
    """A decoded row with each run of the image token's text shown once with its count (<|image_pad|>×6)."""
    escaped = re.escape(piece)
    return re.sub(f"(?:{escaped})+", lambda m: f"{piece}×{len(m.group(0)) // len(piece)}", text)


def image_spans(tokens: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray, image_token_id: int) -> list[str]:
    """Where a row's images sit: each run of image placeholders with its columns, merged grid and the positions
    [T, 3] (t, h, w) its tokens get."""
    image = tokens == image_token_id
    out, count, start = [], {}, None
    for j in range(len(tokens) + 1):
        if j < len(tokens) and image[j] and start is None:
            start = j
        elif start is not None and (j == len(tokens) or not image[j]):
            t, h, w = (positions[start:j, s] for s in range(3))
            seg = int(segment_ids[start])
            count[seg] = count.get(seg, 0) + 1
            span = lambda a: f"{a.min()}" if a.min() == a.max() else f"{a.min()}-{a.max()}"  # noqa: E731
            out.append(f"image {count[seg]} of segment {seg}: columns {start}-{j - 1} ({j - start} tokens, merged "
                       f"grid {h.max() - h.min() + 1}x{w.max() - w.min() + 1}) at t={span(t)} h={span(h)} w={span(w)}")
            start = None
    return out

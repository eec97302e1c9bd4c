"""SFT on image conversations for Llama 4 (data/image_conversations.py with towers.TowerImages' tiles): the chat
template's <|image|> expanded as transformers' Llama4Processor does (<|image_start|>, each tile's <|patch|> tokens
with the tile separators, <|image|> and the global view's, <|image_end|>), the tiles its image processor's; packing
by tokens and whole tiles; row-laid tiles give the flat tiles' logits; the one-line refusals; and a tiny Llama 4
trained through train.main (slow)."""

import os

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain.data import DataError, conversations, image_conversations, image_layout, images_llama4
from maxtrain.models import image_batch
from post_helpers import compose
import image_chat_helpers as helpers
import llama4_image_helpers as l4

pytest.importorskip("PIL.Image")
pytest.importorskip("tokenizers")
SPEC = images_llama4.Llama4VisionPreprocess.from_config({**l4.PROCESSOR, "patch_size": 4})
SIZES = [(16, 24), (24, 16), (24, 40), (40, 10), (64, 64), (10, 10), (33, 50)]  # (height, width)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return l4.make_dataset(str(tmp_path_factory.mktemp("llama4_images")))


def _config(dataset, tmp_path, *extra):
    return config_lib.with_devices(config_lib.load_config(compose(
        BASE_YML, *TINY, f"base_output_directory={tmp_path}", *l4.model_args(dataset), *extra)), 1)


def _vision(config):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel

    return Model.bind(config).family.vision


def _converter(config):
    template = conversations.open_template(config, data_lib.sources.load_tokenizer(config, None, None))
    return conversations.converter(template, config, "train", lambda *_: None, _vision(config))


def _noise_record(directory, height, width, seed=0):
    rel = f"images/noise_{height}x{width}.png"
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    pillow = pytest.importorskip("PIL.Image")
    image = pillow.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    image.save(os.path.join(directory, rel))
    return image, {"messages": [{"role": "user", "content": [{"type": "image", "image": rel},
                                                             {"type": "text", "text": "colour?"}]},
                                {"role": "assistant", "content": "red"}]}


def test_a_record_renders_the_tiles_image_text_with_loss_on_the_answer(dataset, tmp_path):
    config = _config(dataset, tmp_path)
    convert, ids = _converter(config), l4.ids()
    tok = data_lib.sources.load_tokenizer(config, None, None)
    for height, width in SIZES:
        image, record = _noise_record(dataset["dir"], height, width)
        element = convert((f"{dataset['train']} line 1", record))
        want = images_llama4.llama4(image, SPEC)
        tokens, weights = element["tokens"], element["weights"]
        start, end = (int(np.flatnonzero(tokens == ids[s])[0]) for s in ("<|image_start|>", "<|image_end|>"))
        assert [tok.piece(t) for t in tokens[start:end + 1]] == want.tokens, (height, width)
        assert (weights[start:end + 1] == 0).all() and tok.decode(tokens[weights > 0]) == "red<|eot|>"
        tiles = want.pixel_values.shape[0]
        assert tuple(element["image_grids"][0]) == (tiles, 4, 4) and element["pixel_values"].shape == (tiles * 16, 48)
        np.testing.assert_array_equal(images_llama4.tiles_of(element["pixel_values"], SPEC), want.pixel_values)
        np.testing.assert_array_equal(element["positions"][:, 0], np.arange(len(tokens)))
    assert want.aspect_ratio == (2, 2)  # 33 x 50 pixels: four tiles, and the global view


def test_patches_of_and_tiles_of_are_the_encoders_unfold_and_its_inverse():
    from maxtrain.models.vision import llama4  # pylint: disable=import-outside-toplevel

    tiles = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)
    config = llama4.VisionConfig(**{**l4.VISION, "text_hidden_size": 32})
    patches = images_llama4.patches_of(tiles, SPEC)
    np.testing.assert_array_equal(patches, np.asarray(llama4.patches(tiles, config)).reshape(48, 48))
    np.testing.assert_array_equal(images_llama4.tiles_of(patches, SPEC), tiles)
    assert not np.array_equal(patches, tiles.reshape(48, 48))  # the control: not a plain reshape


@pytest.mark.slow  # ~15 s: importing torch and transformers
@pytest.mark.parametrize("size", SIZES)
def test_the_ids_and_tiles_are_transformers_llama4_processors(dataset, tmp_path, size):
    """Llama4Processor's apply_chat_template (its expansion of <|image|>, its tokenizer) on the record gives our
    element's ids; the tiles are the image processor's (exactly here; Llama4ImageProcessor, which needs
    torchvision, within test_images' tolerance)."""
    transformers = pytest.importorskip("transformers")
    from transformers.image_processing_utils import BaseImageProcessor, BatchFeature  # pylint: disable=import-outside-toplevel

    class Tiles(BaseImageProcessor):  # our tiles under the image processor's names
        model_input_names = ["pixel_values"]

        def __call__(self, images, **kwargs):
            out = [images_llama4.llama4(i, SPEC) for i in images]
            return BatchFeature({"pixel_values": np.concatenate([o.pixel_values for o in out]),
                                 "aspect_ratios": np.array([o.aspect_ratio for o in out])})

        preprocess = __call__

    config = _config(dataset, tmp_path)
    image, record = _noise_record(dataset["dir"], *size)
    element = _converter(config)((f"{dataset['train']} line 1", record))
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(dataset["tokenizer"])
    processor = transformers.Llama4Processor(image_processor=Tiles(), tokenizer=tokenizer, patch_size=4,
                                             chat_template=l4.TEMPLATE)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": "red"}]
    theirs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="np")
    assert element["tokens"].tolist() == theirs["input_ids"][0].tolist()
    tiles = images_llama4.tiles_of(element["pixel_values"], SPEC)
    np.testing.assert_array_equal(tiles, theirs["pixel_values"])
    try:
        from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor  # pylint: disable=import-outside-toplevel

        torch_tiles = Llama4ImageProcessor(**l4.PROCESSOR)(image, return_tensors="pt")["pixel_values"].float().numpy()
    except (ImportError, ModuleNotFoundError, RuntimeError):  # torchvision is not installed
        return
    from test_images import LLAMA4_TOLERANCE  # pylint: disable=import-outside-toplevel

    assert tiles.shape == torch_tiles.shape and np.abs(tiles - torch_tiles).max() <= LLAMA4_TOLERANCE


def _packed_batch(dataset, tmp_path, tiles_per_row=10):
    """A batch of rows packing conversations (each one image of three tiles), tiles_per_row tiles a row."""
    config = _config(dataset, tmp_path, "max_target_length=160", f"image_patches_per_row={tiles_per_row * l4.TILE}",
                     "attention=dot_product")
    batch = {k: v[0] for k, v in next(data_lib.make_inputs(config, log=lambda *_: None,
                                                           vision=_vision(config)).train_iterator).items()}
    return config, batch


def test_packed_rows_keep_each_images_text_whole_and_lay_its_tiles_out_by_row(dataset, tmp_path):
    _, batch = _packed_batch(dataset, tmp_path)
    ids = l4.ids()
    rows = batch["inputs"].shape[0]
    assert batch["rows_pixel_values"].shape == (rows, 10, 3, 16, 16) and batch["rows_tile_mask"].shape == (rows, 10)
    assert batch["positions"].ndim == 2
    for r in range(rows):
        tokens, seg = batch["inputs"][r], batch["segment_ids"][r]
        starts, ends = np.flatnonzero(tokens == ids["<|image_start|>"]), np.flatnonzero(tokens == ids["<|image_end|>"])
        assert len(starts) == len(ends) and (ends - starts == 16).all()  # 1 x 2 tiles and the view: 17 tokens
        assert all(len(set(seg[s:e + 1])) == 1 for s, e in zip(starts, ends))
        assert batch["rows_tile_mask"][r].sum() == 3 * len(starts) == (tokens == ids["<|patch|>"]).sum() // 4
        assert (batch["loss_weights"][r][tokens == ids["<|patch|>"]] == 0).all()
    assert max(batch["rows_tile_mask"].sum(axis=1)) == 9  # three conversations in a row of 10 tiles


@pytest.mark.slow  # ~30 s on 2 cores: the tiny tower and decoder compiled twice
def test_row_laid_tiles_give_the_logits_of_the_flat_tiles_and_the_tower_a_gradient(dataset, tmp_path):
    from maxtrain.models.families import llama4  # pylint: disable=import-outside-toplevel
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config, batch = _packed_batch(dataset, tmp_path)
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.PRNGKey(0))
    by_row = image_batch.images(model, batch)
    real = batch["rows_tile_mask"] > 0
    flat = llama4.image_inputs(batch["rows_pixel_values"][real], config)  # every row's tiles, in token order
    padded = llama4.image_inputs(batch["rows_pixel_values"].reshape(-1, 3, 16, 16), config)  # the control
    padded["tile_mask"] = real.reshape(-1).astype(np.int32)
    eager = lambda images: helpers.forward(model, params, rt, batch["inputs"], batch["positions"],  # noqa: E731
                                           batch["segment_ids"], images, jit=False)  # three shapes: no compiles
    logits, want, control = eager(by_row), eager(flat), eager(padded)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(control, want, rtol=1e-5, atol=1e-5)  # flat tiles with each row's padding read wrongly
    loss, grads = jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, rt)[0]))(params)
    assert np.isfinite(float(loss))
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads["vision"])) > 0


def _split_rows(dataset, tmp_path):
    """(config, finish, raw rows [1, 4, ...]): 7 conversations (one of text alone) packed first-fit, two images
    (6 tiles) a row at most, so that the rows' slots are padded unevenly."""
    config = _config(dataset, tmp_path, "max_target_length=120", f"image_patches_per_row={6 * l4.TILE}",
                     "attention=dot_product")
    convert = _converter(config)
    text = {"messages": [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "none"}]}
    raw = helpers.raw_rows(config, convert, [dataset["records"][0], text, *dataset["records"][1:6]],
                           dataset["train"], 4)
    return config, image_conversations.finisher(config, convert), raw


def test_rows_split_over_two_hosts_lay_out_their_tiles_as_one_host(dataset, tmp_path):
    _, finish, raw = _split_rows(dataset, tmp_path)
    counts = [int(g.any(axis=1).sum()) for g in raw["image_grids"][0]]
    assert min(counts) < 2 == max(counts), counts  # the slots are padded unevenly
    whole, split = finish(raw), helpers.halves(finish, raw)
    assert whole["rows_pixel_values"].shape == (1, 4, 6, 3, 16, 16)
    for k in whole:
        np.testing.assert_array_equal(split[k], whole[k], err_msg=k)
    assert (whole["rows_tile_mask"][0].sum(axis=1) == 3 * np.asarray(counts)).all()
    old = helpers.flat_layout(finish, raw), helpers.halves(lambda part: helpers.flat_layout(finish, part), raw)
    assert not np.array_equal(old[0]["rows_tile_mask"], old[1]["rows_tile_mask"])  # the control


@pytest.mark.slow  # ~40 s on 2 cores: the tiny tower and decoder on the batch and on each row
def test_rows_split_over_two_hosts_give_each_rows_logits_alone(dataset, tmp_path):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config, finish, raw = _split_rows(dataset, tmp_path)
    model, rt = Model.bind(config), Runtime.from_config(config)
    assert helpers.check_rows_split_over_hosts(model, model.init_params(jax.random.PRNGKey(0)), rt, finish, raw)


def _bad(dataset, tmp_path, record_image, *extra):
    import shutil  # pylint: disable=import-outside-toplevel

    directory = tmp_path / "bad"
    directory.mkdir(exist_ok=True)
    if not (directory / "tokenizer").exists():
        shutil.copytree(dataset["tokenizer"], directory / "tokenizer")
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": record_image}]},
                           {"role": "assistant", "content": "red"}]}
    path = helpers.write_jsonl(str(directory / "bad.jsonl"), [record])
    config = _config({**dataset, "train": path, "tokenizer": str(directory / "tokenizer")}, tmp_path, *extra)
    with pytest.raises(DataError) as e:
        next(data_lib.make_inputs(config, log=lambda *_: None, vision=_vision(config)).train_iterator)
    message = str(e.value)
    assert "\n" not in message
    return message, path


def test_missing_images_too_many_tiles_and_a_bad_row_budget_get_one_line(dataset, tmp_path):
    message, path = _bad(dataset, tmp_path, "images/none.png")
    assert f"{path} line 1" in message and "('images/none.png') is not found" in message
    helpers.write_png(str(tmp_path / "bad" / "big.png"), (64, 64), (0, 0, 0))  # four tiles and the view: 80 patches
    message, path = _bad(dataset, tmp_path, "big.png", f"image_patches_per_row={3 * l4.TILE}")
    assert f"{path} line 1" in message and "need 80 patches but a row holds image_patches_per_row=48" in message
    assert "(the processor's max_patches tiles)" in message
    message, _ = _bad(dataset, tmp_path, "big.png", "image_patches_per_row=40")
    assert "image_patches_per_row=40 is not a whole number of the tower's tiles of 16 patches" in message
    assert "e.g. 80" in message


def test_a_tokenizer_without_llama4s_image_pieces_or_tiles_not_the_towers_get_one_line(dataset, tmp_path):
    import json  # pylint: disable=import-outside-toplevel

    sentencepiece = helpers.make_dataset(str(tmp_path / "sp"), 2)  # Qwen's image pieces, not Llama 4's
    config = _config({**dataset, "tokenizer": sentencepiece["tokenizer"]}, tmp_path, "chat_template=chatml",
                     "vocab_size=384")
    with pytest.raises(DataError, match=r"the tokenizer has no '<\|image_start\|>' piece.*checkpoint's own tokenizer"):
        _converter(config)
    (tmp_path / "tiles").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tiles" / name).write_text(open(os.path.join(dataset["tokenizer"], name)).read())
    (tmp_path / "tiles" / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 32, "width": 32}}))
    config = _config({**dataset, "tokenizer": str(tmp_path / "tiles")}, tmp_path)
    with pytest.raises(DataError, match="tiles of 32 pixels but the tower reads tiles of image_size=16"):
        _converter(config)


def test_a_truncated_conversation_drops_a_cut_image_with_its_whole_text():
    start, marker, patch, end = 7, 8, 9, 10
    image = [start, patch, patch, marker, patch, patch, end]
    tokens = np.array([1, *image, 3, *image, 4], np.int32)
    n = len(tokens)
    element = {"tokens": tokens, "weights": np.ones(n, np.float32), "parts": np.ones(n, np.int32),
               "positions": np.zeros((n, 1), np.int32), "pixel_values": np.arange(8, dtype=np.float32)[:, None],
               "image_grids": np.array([[2, 1, 2]] * 2, np.int32)}
    kept, was_cut = image_layout.cut(element, 15, patch, bounds=(start, end))  # the 2nd image's last patch at 14
    assert was_cut and list(kept["tokens"]) == [1, *image, 3]
    assert kept["pixel_values"].shape == (4, 1) and len(kept["image_grids"]) == 1
    kept, _ = image_layout.cut(element, 16, patch, bounds=(start, end))  # its patches all inputs: kept
    assert list(kept["tokens"]) == list(tokens[:16]) and len(kept["image_grids"]) == 2
    runs, _ = image_layout.cut(element, 15, patch)  # the control: runs of placeholders split an image in two
    assert len(runs["image_grids"]) == 2


def test_train_compiles_images_line_reads_llama4s_tiles():
    from maxtrain.compile import report  # pylint: disable=import-outside-toplevel

    assert report.images_line([1, 8, 5, 3, 16, 16]).startswith(
        "images      5 tile(s) per row of 3 x 16 x 16 values, 8 rows per micro-batch")


@pytest.mark.slow  # ~40 s: a tiny Llama 4 compiled and trained 2 steps by train.main
def test_a_tiny_llama4_trains_on_image_conversations_through_train_main(dataset, tmp_path, capsys):
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    train.main(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", "run_name=llama4_images",
                       *l4.model_args(dataset), "steps=2", "log_period=1"))
    out = capsys.readouterr().out
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if "| loss " in line]
    assert len(losses) == 2 and all(np.isfinite(losses))

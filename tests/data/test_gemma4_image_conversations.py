"""SFT on image conversations for Gemma 4 (data/image_conversations.py with towers.TowerImages' fixed blocks): each
image token expanded as transformers' Gemma4Processor does (boi, the soft tokens, eoi), its pixels and positions the
processor's; packing by tokens and whole image blocks; a packed row's logits equal each conversation's alone; the
tower's gradient; the one-line refusals; and a tiny Gemma 4 trained through train.main (slow)."""

import os
import types

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain.data import DataError, conversations, image_conversations, image_layout, images
from maxtrain.models import image_batch
from post_helpers import compose
import gemma4_image_helpers as g4
import image_chat_helpers as helpers

pytest.importorskip("PIL.Image")
SPEC = images.Gemma4VisionPreprocess.from_config(g4.PROCESSOR)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return g4.make_dataset(str(tmp_path_factory.mktemp("gemma4_images")))


def _config(dataset, tmp_path, *extra):
    return config_lib.with_devices(config_lib.load_config(compose(
        BASE_YML, *TINY, f"base_output_directory={tmp_path}", *g4.model_args(dataset), *extra)), 1)


def _vision(config):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel

    return Model.bind(config).family.vision


def _element(config, located):
    template = conversations.open_template(config, data_lib.sources.load_tokenizer(config, None, None))
    return conversations.converter(template, config, "train", lambda *_: None, _vision(config))(located)


def _first(dataset, config):
    from PIL import Image  # pylint: disable=import-outside-toplevel

    record = dataset["records"][0]
    element = _element(config, (f"{dataset['train']} line 1", record))
    image = Image.open(os.path.join(dataset["dir"], record["messages"][0]["content"][0]["image"]))
    return record, element, image


def test_a_record_renders_as_the_processor_with_boi_soft_tokens_eoi_and_loss_on_the_answer(dataset, tmp_path):
    config = _config(dataset, tmp_path)
    record, element, image = _first(dataset, config)
    boi, soft, eoi = g4.ids(dataset["tokenizer"])
    want = images.gemma4(image, SPEC)
    tokens, weights = element["tokens"], element["weights"]
    at = int(np.flatnonzero(tokens == boi)[0])
    assert want.num_tokens == 60  # 16x24 pixels -> 48x80 -> 12x20 patches -> 6x10 soft tokens
    assert list(tokens[at:at + want.num_tokens + 2]) == [boi] + [soft] * want.num_tokens + [eoi]
    assert (tokens == soft).sum() == want.num_tokens and (tokens == boi).sum() == (tokens == eoi).sum() == 1
    np.testing.assert_array_equal(element["pixel_values"], want.pixel_values)
    np.testing.assert_array_equal(element["image_position_ids"], want.position_ids)
    assert element["pixel_values"].shape == (g4.BLOCK, 48) and tuple(element["image_grids"][0]) == (1, 1, g4.BLOCK)
    tok = data_lib.sources.load_tokenizer(config, None, None)
    assert tok.decode(tokens[weights > 0]) == record["messages"][1]["content"] + "<|im_end|>\n"
    np.testing.assert_array_equal(element["positions"][:, 0], np.arange(len(tokens)))


@pytest.mark.slow  # ~15 s: importing torch and transformers
def test_the_expansion_and_arrays_are_transformers_gemma4_processors(dataset, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    config = _config(dataset, tmp_path)
    _, element, image = _first(dataset, config)
    theirs = transformers.Gemma4ImageProcessorPil(**g4.PROCESSOR)(image, return_tensors="np")
    n = int(theirs["num_soft_tokens_per_image"][0])
    names = types.SimpleNamespace(boi_token=g4.SYMBOLS[0], image_token=g4.SYMBOLS[1], eoi_token=g4.SYMBOLS[2])
    text = transformers.Gemma4Processor.replace_image_token(names, {"num_soft_tokens_per_image": [n]}, 0)
    tokens = element["tokens"]
    at = int(np.flatnonzero(tokens == g4.ids(dataset["tokenizer"])[0])[0])
    assert data_lib.sources.load_tokenizer(config, None, None).decode(tokens[at:at + n + 2]) == text
    np.testing.assert_array_equal(element["pixel_values"], np.asarray(theirs["pixel_values"][0]))
    np.testing.assert_array_equal(element["image_position_ids"], np.asarray(theirs["image_position_ids"][0]))


def _packed_batch(dataset, tmp_path):
    """A batch whose first row packs two conversations with one image each (2 blocks of patches a row)."""
    config = _config(dataset, tmp_path, "max_target_length=160", f"image_patches_per_row={2 * g4.BLOCK}",
                     "attention=dot_product")
    batch = {k: v[0] for k, v in next(data_lib.make_inputs(config, log=lambda *_: None,
                                                           vision=_vision(config)).train_iterator).items()}
    return config, batch


@pytest.mark.slow  # ~45 s on 2 cores: two compiles of the tiny tower and decoder
def test_a_packed_rows_logits_equal_each_conversations_alone(dataset, tmp_path):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config, batch = _packed_batch(dataset, tmp_path)
    boi = g4.ids(dataset["tokenizer"])[0]
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.PRNGKey(0))
    by_row = image_batch.images(model, batch)
    flat, _ = image_batch.by_row(by_row, model.family.vision.input_keys, batch["inputs"].shape[0])
    assert flat["pixel_values"].shape == (2 * batch["inputs"].shape[0], g4.BLOCK, 48)  # the fixed layout
    logits = helpers.forward(model, params, rt, batch["inputs"], image_batch.positions(batch), batch["segment_ids"],
                             by_row)  # jitted, at the highest matmul precision
    tokens, seg = batch["inputs"][0], batch["segment_ids"][0]
    segments = [s for s in np.unique(seg[seg > 0]) if (tokens[seg == s] == boi).any()]
    assert len(segments) == 2  # two conversations, each with its image, in row 0
    first = 0
    for s in segments:
        alone = tokens[seg == s][None]
        n = int((alone == boi).sum())
        images_alone = {k: v[first:first + n] for k, v in flat.items()}
        first += n
        want = helpers.forward(model, params, rt, alone, np.arange(alone.shape[1])[None], np.ones_like(alone),
                               images_alone)
        np.testing.assert_allclose(logits[0][seg == s], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~20 s on 2 cores: the tiny tower and decoder's gradient compiled
def test_packed_rows_keep_image_blocks_whole_and_the_tower_gets_a_gradient(dataset, tmp_path):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config, batch = _packed_batch(dataset, tmp_path)
    boi, soft, eoi = g4.ids(dataset["tokenizer"])
    rows = batch["inputs"].shape[0]
    assert batch["rows_pixel_values"].shape == (rows, 2, g4.BLOCK, 48) and batch["positions"].ndim == 2
    tokens, seg = batch["inputs"][0], batch["segment_ids"][0]
    for at in np.flatnonzero(tokens == boi):  # every image whole: boi, 60 soft tokens, eoi in one conversation
        assert tokens[at + 61] == eoi and (tokens[at + 1:at + 61] == soft).all() and len(set(seg[at:at + 62])) == 1
    assert (batch["loss_weights"][0][tokens == soft] == 0).all()
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.PRNGKey(0))
    loss, grads = jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, rt)[0]))(params)
    assert np.isfinite(float(loss))
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads["vision"])) > 0


def _split_rows(dataset, tmp_path):
    """(config, finish, raw rows [1, 4, ...]): 7 conversations (one of text alone) packed first-fit, two image
    blocks a row at most, so that the rows' slots are padded unevenly."""
    config = _config(dataset, tmp_path, "max_target_length=160", f"image_patches_per_row={2 * g4.BLOCK}",
                     "attention=dot_product")
    template = conversations.open_template(config, data_lib.sources.load_tokenizer(config, None, None))
    convert = conversations.converter(template, config, "train", lambda *_: None, _vision(config))
    text = {"messages": [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "none"}]}
    raw = helpers.raw_rows(config, convert, [dataset["records"][0], text, *dataset["records"][1:6]],
                           dataset["train"], 4)
    return config, image_conversations.finisher(config, convert), raw


def test_rows_split_over_two_hosts_lay_out_their_image_blocks_as_one_host(dataset, tmp_path):
    _, finish, raw = _split_rows(dataset, tmp_path)
    counts = [int(g.any(axis=1).sum()) for g in raw["image_grids"][0]]
    assert min(counts) < 2 == max(counts), counts  # the slots are padded unevenly
    whole, split = finish(raw), helpers.halves(finish, raw)
    assert whole["rows_pixel_values"].shape == (1, 4, 2, g4.BLOCK, 48)
    for k in whole:
        np.testing.assert_array_equal(split[k], whole[k], err_msg=k)
    real = (whole["rows_image_position_ids"][0] != -1).all(axis=-1).any(axis=-1)  # [rows, blocks]: a real image
    assert real.sum(axis=1).tolist() == counts and not (real[:, 1] & ~real[:, 0]).any()  # first in its own slot
    old = helpers.flat_layout(finish, raw), helpers.halves(lambda part: helpers.flat_layout(finish, part), raw)
    assert not np.array_equal(old[0]["rows_image_position_ids"], old[1]["rows_image_position_ids"])  # the control


@pytest.mark.slow  # ~40 s on 2 cores: the tiny tower and decoder on the batch and on each row
def test_rows_split_over_two_hosts_give_each_rows_logits_alone(dataset, tmp_path):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config, finish, raw = _split_rows(dataset, tmp_path)
    model, rt = Model.bind(config), Runtime.from_config(config)
    # the flat model's logits did not depend on where padding blocks sit (its fill skips their soft tokens), so the
    # control here is the layout's (check_rows_split_over_hosts: the flat layouts of one and two hosts differ)
    helpers.check_rows_split_over_hosts(model, model.init_params(jax.random.PRNGKey(0)), rt, finish, raw)


def _bad(dataset, tmp_path, record_image, *extra):
    import shutil  # pylint: disable=import-outside-toplevel

    directory = tmp_path / "bad"
    directory.mkdir(exist_ok=True)
    shutil.copy(dataset["tokenizer"], directory / "tok.model")
    shutil.copy(os.path.join(dataset["dir"], "preprocessor_config.json"), directory)
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": record_image}]},
                           {"role": "assistant", "content": "red"}]}
    path = helpers.write_jsonl(str(directory / "bad.jsonl"), [record])
    config = _config({**dataset, "train": path, "tokenizer": str(directory / "tok.model")}, tmp_path, *extra)
    with pytest.raises(DataError) as e:
        next(data_lib.make_inputs(config, log=lambda *_: None, vision=_vision(config)).train_iterator)
    message = str(e.value)
    assert "\n" not in message
    return message, path


def test_missing_or_oversized_images_and_a_bad_row_budget_get_one_line(dataset, tmp_path):
    message, path = _bad(dataset, tmp_path, "images/none.png")
    assert f"{path} line 1" in message and "('images/none.png') is not found" in message
    helpers.write_png(str(tmp_path / "bad" / "big.png"), (16, 24), (0, 0, 0))
    message, path = _bad(dataset, tmp_path, "big.png", "max_image_pixels=300")
    assert f"{path} line 1" in message and "16x24 pixels, over max_image_pixels=300" in message
    message, _ = _bad(dataset, tmp_path, "big.png", "image_patches_per_row=300")
    assert "image_patches_per_row=300 is not a multiple of the 280 patches" in message and "e.g. 280" in message


def test_train_compiles_images_line_reads_gemma4s_blocks():
    from maxtrain.compile import report  # pylint: disable=import-outside-toplevel

    assert report.images_line([1, 8, 2, 280, 48]).startswith(
        "images      2 image(s) per row of 280 patches (image_patches_per_row=560) of 48 values, 8 rows")


@pytest.mark.slow  # ~40 s: a tiny Gemma 4 compiled and trained 2 steps by train.main
def test_a_tiny_gemma4_trains_on_image_conversations_through_train_main(dataset, tmp_path, capsys):
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    train.main(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", "run_name=gemma4_images",
                       *g4.model_args(dataset), "steps=2", "log_period=1"))
    out = capsys.readouterr().out
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if "| loss " in line]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_a_truncated_conversation_drops_a_cut_image_with_its_begin_of_image_token():
    boi, image, eoi = 7, 9, 8
    tokens = np.array([1, boi, image, image, eoi, 3, boi, image, image, eoi, 4], np.int32)
    n = len(tokens)
    element = {"tokens": tokens, "weights": np.ones(n, np.float32), "parts": np.ones(n, np.int32),
               "positions": np.zeros((n, 1), np.int32), "pixel_values": np.arange(8, dtype=np.float32)[:, None],
               "image_position_ids": np.zeros((8, 2), np.int32), "image_grids": np.array([[1, 1, 4]] * 2, np.int32)}
    kept, was_cut = image_layout.cut(element, 9, image, lead=1)  # the second image would end at the last token
    assert was_cut and list(kept["tokens"]) == [1, boi, image, image, eoi, 3]
    assert kept["pixel_values"].shape == (4, 1) and kept["image_position_ids"].shape == (4, 2)
    assert len(kept["image_grids"]) == 1


def test_inspect_data_shows_each_image_run_once_with_its_count(dataset, tmp_path, capsys):
    from maxtrain import inspect_data  # pylint: disable=import-outside-toplevel

    inspect_data.main([*compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", *g4.model_args(dataset)),
                       "--batches", "1", "--rows", "1"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("row 0"))
    assert "<start_of_image><image_soft_token>×60<end_of_image>" in row

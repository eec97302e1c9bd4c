"""SFT on image conversations (data/image_conversations.py): records with image items rendered with the chat template
and expanded to the processor's placeholder counts, loss on the assistant's tokens; parquet bytes; packing by tokens
and patches with per-conversation M-RoPE positions; decoding in Grain's workers; the one-line errors; and a tiny
qwen3_vl trained through train.main, data parallel and sharded (slow)."""

import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain.data import DataError, conversations, image_conversations, image_layout, images
from maxtrain.models.vision import qwen_images
from post_helpers import compose
import image_chat_helpers as helpers

pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return helpers.make_dataset(str(tmp_path_factory.mktemp("images")))


def _config(dataset, tmp_path, *extra, devices: int = 1):
    return config_lib.with_devices(config_lib.load_config(compose(
        BASE_YML, *TINY, f"base_output_directory={tmp_path}", *helpers.model_args(dataset), *extra)), devices)


def _vision(config):
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel

    return Model.bind(config).family.vision


def _inputs(config):
    return data_lib.make_inputs(config, log=lambda *_: None, vision=_vision(config))


def _element(config, located):
    template = conversations.open_template(config, data_lib.sources.load_tokenizer(config, None, None))
    return conversations.converter(template, config, "train", lambda *_: None, _vision(config))(located)


def test_a_record_renders_with_its_image_expanded_and_loss_on_the_answer_only(dataset, tmp_path):
    config = _config(dataset, tmp_path)
    record = dataset["records"][0]
    element = _element(config, (f"{dataset['train']} line 1", record))
    tokens, weights, image = element["tokens"], element["weights"], element["tokens"] == config.image_token_id
    image_path = os.path.join(dataset["dir"], record["messages"][0]["content"][0]["image"])
    from PIL import Image  # pylint: disable=import-outside-toplevel

    spec = images.QwenVisionPreprocess.from_config({**images.QWEN3_VL, **helpers.PROCESSOR, "patch_size": 4})
    want = images.qwen_vl(Image.open(image_path), spec)
    assert image.sum() == want.num_tokens == 6 and np.ptp(np.flatnonzero(image)) == 5  # one run of 6 placeholders
    np.testing.assert_array_equal(element["pixel_values"], want.pixel_values)
    assert tuple(element["image_grids"][0]) == want.grid_thw
    tok = data_lib.sources.load_tokenizer(config, None, None)
    assert tok.decode(tokens[weights > 0]) == record["messages"][1]["content"] + "<|im_end|>\n"
    want_positions = qwen_images.rope_index(tokens[None], element["image_grids"], config.image_token_id, 2)[:, 0].T
    np.testing.assert_array_equal(element["positions"], want_positions)


def test_parquet_image_bytes_in_the_items_or_as_datasets_structs(dataset, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    config = _config(dataset, tmp_path, "dataset_type=parquet")
    png = open(os.path.join(dataset["dir"], dataset["records"][0]["messages"][0]["content"][0]["image"]), "rb").read()
    answer = [{"type": "text", "text": "red", "image": None}]
    in_items = [{"messages": [{"role": "user", "content": [{"type": "image", "text": None, "image": png},
                                                          {"type": "text", "text": "colour?", "image": None}]},
                              {"role": "assistant", "content": answer}]}]
    structs = [{"messages": [{"role": "user", "content": [{"type": "image", "text": None},
                                                         {"type": "text", "text": "colour?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
                "images": [{"bytes": png, "path": "x.png"}]}]
    want = _element(config, (f"{dataset['train']} line 1", dataset["records"][0]))["pixel_values"]
    for name, rows in (("items", in_items), ("structs", structs)):
        path = str(tmp_path / f"{name}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
        located = next(conversations.read_records(path))
        element = _element(config, located)
        np.testing.assert_array_equal(element["pixel_values"], want)
        assert (element["tokens"] == config.image_token_id).sum() == 6


def test_packed_batches_keep_images_whole_positions_per_conversation_and_fixed_shapes(dataset, tmp_path):
    config = _config(dataset, tmp_path, "image_patches_per_row=32")  # 24 patches an image: one image per row
    it = _inputs(config).train_iterator
    batches = [next(it) for _ in range(2)]
    assert {k: v.shape for k, v in batches[0].items()} == {k: v.shape for k, v in batches[1].items()}
    shapes = image_conversations.batch_shapes(config, _vision(config), batches[0]["inputs"].shape)
    assert {k: v[0] for k, v in shapes.items()} == {k: v.shape for k, v in batches[0].items()}
    for batch in batches:
        tokens, seg, pos = batch["inputs"][0], batch["segment_ids"][0], batch["positions"][0]
        image = tokens == config.image_token_id
        assert image.sum() == (batch["rows_patch_images"][0] > 0).sum() > 0  # every placeholder has its merged token
        assert (batch["loss_weights"][0][image] == 0).all()
        for r in range(tokens.shape[0]):
            runs = np.split(np.flatnonzero(image[r]), np.flatnonzero(np.diff(np.flatnonzero(image[r])) > 1) + 1)
            assert len([run for run in runs if len(run)]) <= 1  # the patch budget holds one image per row
            for run in runs:
                assert len(run) in (0, 6) and len(set(seg[r][run])) <= 1  # whole, in one conversation
            for s in set(seg[r][seg[r] > 0]):
                assert (pos[r][seg[r] == s][0] == 0).all()  # every conversation's three streams start over


@pytest.mark.slow  # ~10 s: starting a Grain worker
def test_images_are_decoded_in_grains_workers(dataset, tmp_path, monkeypatch):
    config = _config(dataset, tmp_path, "grain_worker_count=1")
    inputs = _inputs(config)
    calls = []
    opened = image_conversations.open_image
    monkeypatch.setattr(image_conversations, "open_image", lambda *a: calls.append(a) or opened(*a))
    batch = next(inputs.train_iterator)
    assert (batch["inputs"] == config.image_token_id).sum() > 0 and calls == []  # none opened in this process


def _bad(dataset, tmp_path, record_image, *extra, decoder_block=None, record=None):
    directory = tmp_path / "bad"
    directory.mkdir(exist_ok=True)
    shutil.copy(dataset["tokenizer"], directory / "tok.model")
    shutil.copy(os.path.join(dataset["dir"], "preprocessor_config.json"), directory)
    record = record or {"messages": [{"role": "user", "content": [{"type": "image", "image": record_image}]},
                                     {"role": "assistant", "content": "red"}]}
    path = helpers.write_jsonl(str(directory / "bad.jsonl"), [record])
    paths = {**dataset, "train": path, "tokenizer": str(directory / "tok.model")}
    args = compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", *helpers.model_args(paths), *extra,
                   *([f"decoder_block={decoder_block}", "vision_config=", "mrope_section=[]", "image_token_id=-1"]
                     if decoder_block else []))
    with pytest.raises(DataError) as e:
        _inputs(config_lib.with_devices(config_lib.load_config(args), 1))
    message = str(e.value)
    assert "\n" not in message and f"{path} line 1" in message
    return message, directory


def test_bad_images_get_one_line_naming_the_record_and_the_fix(dataset, tmp_path):
    message, _ = _bad(dataset, tmp_path, "images/none.png")
    assert "('images/none.png') is not found" in message and "relative to the data file" in message
    (tmp_path / "bad" / "text.png").write_text("not an image")
    message, _ = _bad(dataset, tmp_path, "text.png")
    assert "not an image Pillow can read" in message and "re-save it" in message
    helpers.write_png(str(tmp_path / "bad" / "big.png"), (16, 24), (0, 0, 0))
    message, _ = _bad(dataset, tmp_path, "big.png", "max_image_pixels=300")
    assert "16x24 pixels, over max_image_pixels=300" in message and "raise max_image_pixels" in message
    message, _ = _bad(dataset, tmp_path, "big.png", "image_patches_per_row=16")
    assert "need 24 patches" in message and "raise image_patches_per_row to 24" in message
    message, _ = _bad(dataset, tmp_path, "big.png", decoder_block="llama")
    assert "holds images" in message and "decoder_block=llama has no image tower" in message


def _split_rows(dataset, tmp_path):
    """(config, finish, raw rows [1, 4, ...]): 9 conversations (one of text alone) packed first-fit, two images a
    row at most, so that the rows' slots are padded unevenly."""
    config = _config(dataset, tmp_path, "attention=dot_product", "base_num_decoder_layers=1")
    template = conversations.open_template(config, data_lib.sources.load_tokenizer(config, None, None))
    convert = conversations.converter(template, config, "train", lambda *_: None, _vision(config))
    text = {"messages": [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "none"}]}
    records = [dataset["records"][0], text, *dataset["records"][1:8]]
    raw = helpers.raw_rows(config, convert, records, dataset["train"], 4)
    return config, image_conversations.finisher(config, convert), raw


def test_rows_split_over_two_hosts_lay_out_their_images_as_one_host(dataset, tmp_path):
    config, finish, raw = _split_rows(dataset, tmp_path)
    counts = [int(g.any(axis=1).sum()) for g in raw["image_grids"][0]]
    assert min(counts) < 2 == max(counts), counts  # the slots are padded unevenly
    whole, split = finish(raw), helpers.halves(finish, raw)
    for k in whole:
        np.testing.assert_array_equal(split[k], whole[k], err_msg=k)
    rows = whole["rows_patch_images"][0]  # row r's merged tokens fill the start of its own slot
    assert [int((r > 0).sum()) for r in rows] == [6 * c for c in counts]
    assert [int((t == config.image_token_id).sum()) for t in whole["inputs"][0]] == [6 * c for c in counts]
    old = helpers.flat_layout(finish, raw), helpers.halves(lambda part: helpers.flat_layout(finish, part), raw)
    assert not np.array_equal(old[0]["rows_patch_images"], old[1]["rows_patch_images"])  # the control
    with pytest.raises(DataError, match="image_patches_per_row=30 is not a multiple of the tower's 4 patches"):
        image_layout.check_row_budget(finish.tower, 30)  # a row's slot is laid out alone: whole merge windows


@pytest.mark.slow  # ~30 s on 2 cores: the tiny tower and decoder on the batch and on each row
def test_rows_split_over_two_hosts_give_each_rows_logits_alone_and_the_loss(dataset, tmp_path):
    from maxtrain.models import image_batch, ops  # pylint: disable=import-outside-toplevel
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config, finish, raw = _split_rows(dataset, tmp_path)
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.PRNGKey(0))
    assert helpers.check_rows_split_over_hosts(model, params, rt, finish, raw)  # the flat model misplaces images
    batch = {k: v[0] for k, v in helpers.halves(finish, raw).items()}
    loss = jax.jit(lambda p, b: model.loss_fn(p, b, rt)[0])(params, batch)
    logits = helpers.forward(model, params, rt, batch["inputs"], image_batch.positions(batch), batch["segment_ids"],
                             image_batch.images(model, batch))  # the check's compiled forward, reused
    np.testing.assert_allclose(loss, ops.cross_entropy(logits, batch["targets"], batch["loss_weights"]), rtol=1e-5)


def test_inspect_data_shows_where_the_images_sit(dataset, tmp_path, capsys):
    from maxtrain import inspect_data  # pylint: disable=import-outside-toplevel

    inspect_data.main([*compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", *helpers.model_args(dataset)),
                       "--batches", "1", "--rows", "1"])
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("row 0"))
    assert "<|image_pad|>×6" in lines[row]
    assert lines[row + 1].split()[:6] == ["image", "1", "of", "segment", "1:", "columns"]
    assert "(6 tokens, merged grid" in lines[row + 1] and " at t=" in lines[row + 1]


def test_a_truncated_conversation_keeps_only_the_images_wholly_inside_its_inputs():
    image = 9
    tokens = np.array([1, 2, image, image, image, 3, image, image, 4, 5], np.int32)
    element = {"tokens": tokens, "weights": np.ones(10, np.float32), "parts": np.ones(10, np.int32),
               "positions": np.zeros((10, 3), np.int32), "pixel_values": np.arange(28, dtype=np.float32)[:, None],
               "image_grids": np.array([[1, 4, 4], [1, 2, 6]], np.int32)}
    kept, was_cut = image_conversations.cut(element, 8, image)  # the second image would end at the row's last token
    assert was_cut and list(kept["tokens"]) == [1, 2, image, image, image, 3]
    assert kept["image_grids"].tolist() == [[1, 4, 4]] and kept["pixel_values"].shape == (16, 1)
    kept, _ = image_conversations.cut(element, 9, image)  # both whole inside the inputs
    assert len(kept["tokens"]) == 9 and len(kept["image_grids"]) == 2 and kept["pixel_values"].shape == (28, 1)


@pytest.mark.slow  # two short runs on 8 simulated devices (~40 s on 2 cores)
def test_the_tower_shards_as_the_decoder_and_fsdp_with_tensor_parallelism_trains_as_data_parallelism(
        dataset, tmp_path, capsys):
    """The tower's weights follow the decoder's logical-axis rules (FSDP over `embed`, TP over `heads` and `mlp`),
    inside the same jit step: 3 steps on an fsdp 4 x tensor 2 mesh give data parallelism's losses (the weights
    whole on every device) to float32 reduction order. The data-parallel run is also the tiny qwen3_vl trained
    through train.main with image conversations in its eval batches (one run serves both checks)."""
    from maxtrain import train  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    def losses(name, *mesh):
        train.main(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", f"run_name={name}",
                           *helpers.model_args(dataset), "steps=3", "log_period=1", *mesh))
        out = capsys.readouterr().out
        evals = [float(line.split("loss ")[1]) for line in out.splitlines() if line.startswith("eval at step")]
        return np.array([float(line.split("| loss ")[1].split()[0]) for line in out.splitlines()
                         if "| loss " in line]), evals

    sharded = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    run = builder.build(config_lib.load_config(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}",
                                                       *helpers.model_args(dataset), *sharded)))
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        vision = run.init(jax.random.key(0))["params"]["vision"]
    assert vision["blocks"]["wqkv"].sharding.spec == P(None, "fsdp", None, "tensor", None)  # [layers, D, 3, N, H]
    assert vision["blocks"]["w_in"].sharding.spec == P(None, "fsdp", "tensor")
    assert vision["merger"]["w_out"].addressable_shards[0].data.shape[-1] == vision["merger"]["w_out"].shape[-1] // 4
    eval_args = (f"grain_eval_files={dataset['train']}", "eval_data_columns=[messages]", "eval_interval=3",
                 "eval_steps=1")
    want, evals = losses("dp8", "ici_data_parallelism=8", "ici_fsdp_parallelism=1", *eval_args)
    got, _ = losses("fsdp4xtp2", *sharded)
    assert len(want) == 3 and np.all(np.isfinite(want)) and len(evals) == 2
    assert evals[1] < evals[0]  # the eval batches (with their images) go through the eval step too
    np.testing.assert_allclose(got, want, rtol=1e-5)

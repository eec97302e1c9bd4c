"""Token log-probability heatmaps: the numbers, the HTML, the PNG and its TensorBoard event, the hook in
training and `python -m maxtrain.viz` on a checkpoint."""

from __future__ import annotations

import glob
import re
import struct
import zlib
from html.parser import HTMLParser

import data_helpers as h
import jax
import numpy as np
import pytest

from maxtrain.config import with_overrides
from tensorboardX.proto import event_pb2

from maxtrain import config as config_lib
from maxtrain import train, viz
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.observability import heatmap, png
from maxtrain.parallel import sharding
from maxtrain.data import DataError, pipeline
from maxtrain.data import tokenizer as tokenizer_lib

TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=1", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=1", "max_new_tokens=0"]


def decode_png(data: bytes) -> np.ndarray:
    """A strict reader for what encode_png writes: checks the signature, every CRC and the header."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color_type, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[1][1]), np.uint8).reshape(height, 1 + 3 * width)
    assert np.all(raw[:, 0] == 0)  # filter type "none" on every row
    return raw[:, 1:].reshape(height, width, 3)


def read_events(directory) -> list:
    """Every Event in the TensorBoard files of `directory` (TFRecord framing: length, crc, data, crc)."""
    events = []
    for path in sorted(glob.glob(f"{directory}/events.out.tfevents.*")):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            events.append(event)
            pos += 16 + length
    return events


class TokenSpans(HTMLParser):
    """The token spans of a heatmap page: colour, tooltip and text (without the newline marks)."""

    def __init__(self):
        super().__init__()
        self.spans, self.depth, self.in_mark, self.in_pre = [], 0, False, False
        self.stray = ""  # text inside <pre> but outside every token (it would show between tokens)

    @classmethod
    def parse(cls, page: str) -> list[dict]:
        parser = cls()
        parser.feed(page)
        assert parser.stray == "", repr(parser.stray)
        return parser.spans

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.in_pre = self.in_pre or tag == "pre"
        if tag == "span" and self.in_pre and "t" in attrs.get("class", "").split():
            colour = re.search(r"background:(#[0-9a-f]{6})", attrs.get("style") or "")
            self.spans.append({"colour": colour and colour.group(1), "title": attrs["title"], "text": ""})
            self.depth = 1
        elif tag == "span" and self.depth:
            self.in_mark, self.depth = True, self.depth + 1

    def handle_endtag(self, tag):
        self.in_pre = self.in_pre and tag != "pre"
        if tag == "span" and self.depth:
            self.depth -= 1
            self.in_mark = False

    def handle_data(self, data):
        if self.depth and not self.in_mark:
            self.spans[-1]["text"] += data
        elif self.in_pre and not self.depth:
            self.stray += data


def test_png_round_trip_and_font():
    image = np.random.default_rng(0).integers(0, 256, size=(13, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_png(png.encode_png(image)), image)
    glyphs = [png.glyph(chr(c)) for c in range(32, 127)]
    assert all(g.shape == (png.GLYPH_H, png.GLYPH_W) for g in glyphs)
    assert len({g.tobytes() for g in glyphs}) == 95  # every printable character looks different
    canvas = np.full((png.CELL_H, 2 * png.CELL_W, 3), 255, np.uint8)
    png.draw_text(canvas, 0, 0, "A\u00e9", bg=(1, 2, 3))
    assert np.array_equal(canvas[1:8, 0:5].min(axis=-1) == 0, png.glyph("A"))  # ink where the glyph has it
    assert np.array_equal(canvas[1:8, 6:11].min(axis=-1) == 0, png.glyph("\u2603"))  # outside ASCII: a box
    assert np.array_equal(png.glyph("\u00e9"), png.glyph("\u2603")) and not np.array_equal(png.glyph("e"), png.glyph("\u00e9"))


def test_colour_scale_runs_red_to_green():
    red, yellow, green = heatmap.color(-10.0), heatmap.color(-5.0), heatmap.color(0.0)
    assert red == heatmap.color(-50.0) and red[0] > red[1]
    assert yellow[0] > 200 and yellow[1] > 200
    assert green[1] > green[0]
    greenness = [heatmap.color(v)[1] - heatmap.color(v)[0] for v in np.linspace(-10, 0, 21)]
    assert greenness == sorted(greenness) and len(set(greenness)) == 21  # redder to greener, step by step


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step training run with viz_period=1 on the default corpus (it also saves a checkpoint)."""
    out = tmp_path_factory.mktemp("viz")
    argv = ["configs/base.yml", *TINY, f"base_output_directory={out}", "run_name=r", "steps=2", "eval_interval=2",
            "eval_steps=1", "viz_period=1", "viz_num_samples=2", "async_checkpointing=false"]
    result = train.main(argv)
    return {"argv": argv, "result": result, "config": result.config}


@pytest.mark.slow
def test_token_logprobs_match_the_loss(run):
    config, params = run["config"], run["result"].state["params"]
    rt = Runtime.from_config(config)
    tokenizer, _, eval_docs = pipeline.default_corpus_documents(config)
    host = pipeline.eval_batches(eval_docs, config, 0, 1, 1)[0]
    mesh = sharding.create_mesh(config)
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        batch = pipeline.to_global(host, mesh, config.logical_axis_rules, pipeline.EVAL_BATCH_AXES)
        rows = heatmap.token_logprobs(params, batch, Model.bind(config), rt, num_rows=3)
    assert rows["logprobs"].shape == (3, config.max_target_length)
    np.testing.assert_array_equal(rows["targets"], host["targets"][:3])
    first3 = {k: v[:3] for k, v in host.items()}
    loss_sum, weight_sum = jax.jit(lambda p, b: Model.bind(config).loss_fn(p, b, rt)[:2])(params, first3)
    # The loss is minus the mean log-probability of the predicted tokens.
    assert -np.sum(rows["logprobs"] * rows["weights"]) == pytest.approx(float(loss_sum), rel=1e-5)
    assert np.sum(rows["weights"]) == float(weight_sum)
    assert np.all(rows["logprobs"] <= 0)


def test_training_writes_heatmaps_every_viz_period(run):
    config = run["config"]
    tokenizer = pipeline.default_corpus_documents(config)[0]
    for step in (1, 2):
        page = open(f"{config.run_dir}/viz/step_{step}.html", encoding="utf-8").read()
        assert f"at step {step}" in page and page.count("<h2>sample") == 2
        spans = TokenSpans.parse(page)
        # One span per token: each sample's first input plus its T targets.
        assert len(spans) == 2 * (1 + config.max_target_length)
        scored = [s for s in spans if s["colour"]]
        assert scored and all("log p = -" in s["title"] for s in scored)
        assert all("not predicted" in s["title"] for s in spans if not s["colour"])
        assert len({s["colour"] for s in scored}) > 1  # not one colour for everything
        # The spans spell out the first eval sample, token by token.
        host = pipeline.eval_batches(pipeline.default_corpus_documents(config)[2], config, 0, 1, 1)[0]
        ids = [int(host["inputs"][0, 0])] + [int(t) for t in host["targets"][0]]
        assert [s["text"] for s in spans[:len(ids)]] == [heatmap.token_text(tokenizer, i) for i in ids]
        image = decode_png(open(f"{config.run_dir}/viz/step_{step}.png", "rb").read())
        assert image.shape[1] == 2 * 8 + 100 * png.CELL_W * 2
        assert len({tuple(c) for c in image.reshape(-1, 3)[::7]}) > 5  # coloured cells, not a blank page
    images = [(e.step, v) for e in read_events(config.tensorboard_dir) for v in e.summary.value
              if v.tag == "viz/token_logprobs"]
    assert [s for s, _ in images] == [1, 2]
    on_disk = open(f"{config.run_dir}/viz/step_2.png", "rb").read()
    assert images[1][1].image.encoded_image_string == on_disk
    assert (images[1][1].image.width, images[1][1].image.height) == decode_png(on_disk).shape[1::-1]


def test_viz_cli_renders_a_checkpoint(run, capsys):
    """python -m maxtrain.viz configs/base.yml load_parameters_path=<run>/checkpoints/2"""
    config = run["config"]
    step_2 = open(f"{config.run_dir}/viz/step_2.html", encoding="utf-8").read()
    path = viz.main([*run["argv"], f"load_parameters_path={config.checkpoint_dir}/2"])
    assert path == f"{config.run_dir}/viz/step_2.html"
    assert "wrote" in capsys.readouterr().out
    # The checkpoint's params give the page training drew at the same step.
    assert open(path, encoding="utf-8").read() == step_2
    with pytest.raises(config_lib.ConfigError, match="dataset_type=default or set grain_eval_files"):
        viz.main([*run["argv"], "dataset_type=synthetic", f"load_parameters_path={config.checkpoint_dir}/2"])


def test_viz_with_a_hugging_face_tokenizer_smaller_than_the_model(run, tmp_path_factory):
    """A byte-level tokenizer.json of 320 pieces under the 512-id model: tokens read as text ('Ġ' as a space), and a
    tokenizer larger than vocab_size is refused before the checkpoint is read."""
    config = run["config"]
    path = h.tokenizer_path(tmp_path_factory, kind="hf")
    tok = tokenizer_lib.load(path)
    page_path = f"{config.run_dir}/viz/step_2.html"
    drawn_in_training = open(page_path, encoding="utf-8").read()
    try:
        assert viz.main([*run["argv"], f"load_parameters_path={config.checkpoint_dir}/2",
                         f"tokenizer_path={path}"]) == page_path
        spans = TokenSpans.parse(open(page_path, encoding="utf-8").read())
    finally:
        with open(page_path, "w", encoding="utf-8") as f:  # the other tests compare with training's page
            f.write(drawn_in_training)
    eval_docs = pipeline.default_corpus_documents(config.replace(tokenizer_path=path))[2]
    host = pipeline.eval_batches(eval_docs, config, 0, 1, 1)[0]
    ids = [int(host["inputs"][0, 0])] + [int(t) for t in host["targets"][0]]
    assert [s["text"] for s in spans[:len(ids)]] == [tok.piece(i) for i in ids]
    assert spans[0]["text"] == "<|begin_of_text|>" and any(" " in s["text"] for s in spans)
    assert not any("Ġ" in s["text"] or "Ċ" in s["text"] for s in spans)
    with pytest.raises(DataError, match=rf"the tokenizer {path} has 320 pieces but vocab_size=300"):
        viz.main(with_overrides(run["argv"], f"load_parameters_path={config.checkpoint_dir}/2",
                                f"tokenizer_path={path}", "vocab_size=300"))

"""The qwen3_vl family against transformers' Qwen3VLForConditionalGeneration in float32: a tiny random model saved
with save_pretrained, imported with the converter (scripts/convert_hf.py import), run on a batch with two images of
different grids (one row: text, image, text, image, text; the other text alone) and on text alone; M-RoPE's positions
against transformers' get_rope_index; the export loaded back by transformers; check_logits on a golden file with
images; the traced (padded) image layout; one-line errors for bad image inputs."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ckpt_helpers import REPO
from vlm_helpers import export_and_reload, forward, import_tiny, load, relative_error, text_positions
from maxtrain import check_logits
from maxtrain import config as config_lib
from maxtrain.checkpointing import convert
from maxtrain.models.vision import qwen, qwen_images
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime


os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")

VOCAB, IMAGE, VIDEO, START, END = 300, 290, 291, 288, 289
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, in_channels=3,
              deepstack_visual_indexes=[0, 1])
GRID = np.array([[1, 4, 6], [1, 2, 2]])  # 6 and 1 merged tokens


def make_model(seed: int = 0):
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                                        tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = transformers.Qwen3VLForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight drawn (transformers' init zeroes biases, keeps norms at 1)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)
    return model


def image_batch():
    """ids [2, 20]: row 0 text, image 1 (6 placeholders), text, image 2 (1), text; row 1 text alone; and pixels."""
    rng = np.random.default_rng(1)
    text = lambda n: list(rng.integers(0, 280, n))  # noqa: E731
    row0 = text(3) + [START] + [IMAGE] * 6 + [END] + text(2) + [START, IMAGE, END] + text(4)
    ids = np.array([row0, text(len(row0))], np.int32)
    pixels = rng.standard_normal((int(GRID.prod(1).sum()), 3 * 2 * 4 * 4)).astype(np.float32)
    return ids, pixels


def hf_logits(model, ids, pixels=None):
    kwargs = {}
    if pixels is not None:
        kwargs = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(GRID),
                      mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)))
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids.astype(np.int64)), **kwargs).logits.float().numpy()


def ours(config, params, ids, pixels=None, pad_to=None):
    """Our float32 logits, with M-RoPE's positions and the tower's inputs where there are pixels."""
    positions, images = text_positions(ids), None
    if pixels is not None:
        positions, images = qwen_images.model_inputs(config, ids, pixels, GRID, pad_to)
    return forward(config, params, ids, positions, images)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3_vl")
    model = make_model()
    return model, tmp, import_tiny(model, tmp)


def test_imports_the_tower_and_matches_transformers_with_images_and_text_alone(imported):
    model, tmp, keys = imported
    assert keys["decoder_block"] == "qwen3_vl" and keys["mrope_section"] == [2, 3, 3] and keys["image_token_id"] == IMAGE
    config, params = load(tmp / "out")
    assert set(params) >= {"vision", "layers", "token_embedding"}
    ids, pixels = image_batch()
    theirs = hf_logits(model, ids, pixels)
    with_images = relative_error(ours(config, params, ids, pixels), theirs)
    text_ids = np.random.default_rng(2).integers(0, 280, (2, 20)).astype(np.int32)
    text_alone = relative_error(ours(config, params, text_ids), hf_logits(model, text_ids))
    # Measured 2026-11-30 (CPU, float32, seed 0): 1.01e-6 with images, 9.6e-7 text alone.
    print(f"qwen3_vl: relative logits error with images {with_images:.2e}, text alone {text_alone:.2e}")
    assert with_images <= 1e-5 and text_alone <= 1e-5, (with_images, text_alone)
    # the control: without the deepstack features the logits at and after the images move
    no_deepstack = {**params, "vision": {**params["vision"], "deepstack": jax.tree.map(np.zeros_like,
                                                                                       params["vision"]["deepstack"])}}
    assert relative_error(ours(config, no_deepstack, ids, pixels), theirs) > 1e-3


def test_rope_index_is_transformers_get_rope_index(imported):
    model, _, _ = imported
    ids, _ = image_batch()
    theirs, _ = model.model.get_rope_index(torch.from_numpy(ids.astype(np.int64)),
                                           torch.from_numpy((ids == IMAGE).astype(np.int64)),
                                           image_grid_thw=torch.from_numpy(GRID))
    np.testing.assert_array_equal(qwen_images.rope_index(ids, GRID, IMAGE, 2), theirs.numpy())


def test_padded_layout_gives_the_same_logits(imported):
    """The tower's layout padded to more patches (a fixed shape for every batch) changes nothing."""
    _, tmp, _ = imported
    config, params = load(tmp / "out")
    ids, pixels = image_batch()
    np.testing.assert_allclose(ours(config, params, ids, pixels, pad_to=48), ours(config, params, ids, pixels),
                               rtol=0, atol=1e-5)


def test_export_loads_in_transformers_as_the_same_model(imported):
    model, tmp, _ = imported
    reloaded = export_and_reload(tmp, transformers, torch, "Qwen3VLForConditionalGeneration")
    ids, pixels = image_batch()
    difference = relative_error(hf_logits(reloaded, ids, pixels), hf_logits(model, ids, pixels))
    print(f"qwen3_vl export round trip: relative logits error {difference:.2e}")
    assert difference == 0.0


def test_check_logits_reads_images_from_the_golden_file(imported, capsys):
    model, tmp, _ = imported
    ids, pixels = image_batch()
    golden = tmp / "golden.npz"
    np.savez(golden, input_ids=ids, logits=hf_logits(model, ids, pixels), pixel_values=pixels, image_grid_thw=GRID)
    assert check_logits.main([str(tmp / "out"), "--golden", str(golden)]) == 0
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) <= 1e-5
    # --hf: transformers' image-text class on random text (no causal LM class loads a Qwen3-VL directory)
    assert check_logits.main([str(tmp / "out"), "--hf", str(tmp / "hf"), "--length", "16"]) == 0
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) <= 1e-5


def test_placeholders_that_do_not_match_the_images_are_refused(imported):
    _, tmp, _ = imported
    config, _ = load(tmp / "out")
    ids, pixels = image_batch()
    ids[0, 5] = 7  # one placeholder fewer
    with pytest.raises(ValueError, match="placeholders"):
        qwen_images.model_inputs(config, ids, pixels, GRID)


def test_text_only_import_keeps_the_language_model(imported, tmp_path):
    model, tmp, _ = imported
    notes = []
    keys = convert.import_hf(str(tmp / "hf"), str(tmp_path / "text"), log=notes.append, text_only=True)
    assert keys["decoder_block"] == "qwen3" and sum("text decoder" in n for n in notes) == 1, notes
    config, params = load(tmp_path / "text")
    text_ids = np.random.default_rng(2).integers(0, 280, (2, 20)).astype(np.int32)
    assert relative_error(ours(config, params, text_ids), hf_logits(model, text_ids)) <= 1e-5


def test_images_given_to_a_text_only_family_are_refused():
    config = config_lib.load_config([str(REPO / "configs" / "base.yml"), "decoder_block=qwen3", "base_emb_dim=16",
                                     "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=8", "base_mlp_dim=16",
                                     "base_num_decoder_layers=1", "vocab_size=32", "dtype=float32"])
    model = Model.bind(config)
    tokens = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="text-only family"):
        model.forward({}, tokens, tokens, tokens, Runtime.from_config(config), images={"pixel_values": np.zeros(1)})


def test_the_layout_marks_padding_and_images():
    config = qwen.VisionConfig(**{**VISION, "deepstack_visual_indexes": (0, 1)})
    layout = qwen.patch_layout(GRID, config, pad_to=40)
    assert layout.segments.shape == (40,) and list(layout.segments[28:]) == [0] * 12
    assert list(layout.images) == [1] * 6 + [2] + [0] * 3
    with pytest.raises(ValueError, match="multiple of 4"):
        qwen.patch_layout(GRID, config, pad_to=30)


def test_a_training_step_with_other_images_does_not_recompile(imported):
    """The loss and its gradient (the tower's included) for batches of different images, padded to one layout
    size: one compile serves both."""
    _, tmp, _ = imported
    config, params = load(tmp / "out")
    model, rt = Model.bind(config), Runtime.from_config(config)
    step = jax.jit(jax.grad(lambda p, b: model.loss_fn(p, b, rt)[0]))
    rng = np.random.default_rng(3)
    ids0, pixels0 = image_batch()
    ids1 = rng.integers(0, 280, ids0.shape).astype(np.int32)
    ids1[1, 2:6] = [START, IMAGE, IMAGE, END]  # one image of 2 x 4 patches: 2 merged tokens, in the other row
    grids = (GRID, np.array([[1, 2, 4]]))
    pixels1 = rng.standard_normal((8, pixels0.shape[1])).astype(np.float32)
    for ids, pixels, grid in ((ids0, pixels0, grids[0]), (ids1, pixels1, grids[1])):
        images = qwen_images.image_inputs(pixels, grid, config, pad_to=48)
        positions = qwen_images.rope_index(ids, grid, IMAGE, 2)
        batch = {"inputs": ids, "targets": np.roll(ids, -1, axis=1), "positions": positions,
                 "segment_ids": np.ones_like(ids), "loss_weights": np.ones(ids.shape, np.float32), **images}
        grads = step(params, batch)
        assert float(np.abs(grads["vision"]["patch_embed"]).max()) > 0
    assert step._cache_size() == 1


def test_the_import_command_keeps_the_tower_and_text_only_says_so_once(imported, tmp_path):
    _, tmp, _ = imported
    script = str(REPO / "scripts" / "convert_hf.py")
    whole = subprocess.run([sys.executable, script, "import", str(tmp / "hf"), str(tmp_path / "whole")],
                           capture_output=True, text=True, check=False)
    assert whole.returncode == 0 and "model: qwen3_vl" in whole.stdout, whole.stdout + whole.stderr
    text = subprocess.run([sys.executable, script, "import", str(tmp / "hf"), str(tmp_path / "text"), "--text-only"],
                          capture_output=True, text=True, check=False)
    assert text.returncode == 0 and "model: qwen3 " in text.stdout, text.stdout + text.stderr
    assert text.stdout.count("text decoder") == 1, text.stdout


def test_a_batch_without_images_keeps_the_padded_shapes(imported):
    """Text-only rows in a training run that reads images: the layout of no images is all padding, and the
    logits are those of the text alone."""
    _, tmp, _ = imported
    config, params = load(tmp / "out")
    images = qwen_images.image_inputs(np.zeros((0, 96), np.float32), np.zeros((0, 3), np.int64), config, pad_to=48)
    assert images["pixel_values"].shape == (48, 96) and not images["patch_images"].any()
    ids = np.random.default_rng(2).integers(0, 280, (2, 20)).astype(np.int32)
    model, rt = Model.bind(config), Runtime.from_config(config)
    positions = np.broadcast_to(np.arange(20, dtype=np.int32), ids.shape)
    with jax.default_matmul_precision("highest"):
        with_layout = model.forward(params, ids, positions, np.ones_like(ids), rt, images=images)[0]
    np.testing.assert_allclose(with_layout, ours(config, params, ids), rtol=0, atol=1e-5)

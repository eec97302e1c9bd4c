"""The llama4 family against transformers' Llama4ForConditionalGeneration in float32: a tiny random model (chunks of
8 in the RoPE layers, a NoPE layer with attention temperature, experts in every other layer) saved with
save_pretrained, imported with its tower (scripts/convert_hf.py import), run on a batch with two images (three tiles
and one; the other row text alone) and on text alone; the export loaded back by transformers; check_logits on a
golden file with pixel_values; the padded tiles; one-line errors; `--text-only` as llama4_text."""

from __future__ import annotations

import os

import numpy as np
import pytest

from vlm_helpers import export_and_reload, forward, import_tiny, load, relative_error, text_positions
from maxtrain import check_logits
from maxtrain.checkpointing import convert
from maxtrain.models.families import llama4

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")

VOCAB, IMAGE, START, END = 300, 290, 288, 289
TEXT = dict(hidden_size=64, intermediate_size=40, intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
            interleave_moe_layer_step=2, no_rope_layer_interval=3, attention_chunk_size=8, floor_scale=4,
            attn_scale=0.3, max_position_embeddings=128)
# 48-pixel tiles of 8-pixel patches (6 x 6), shuffled 2 x 2 into 9 tokens per tile
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=48,
              patch_size=8, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
              vision_output_dim=48, num_channels=3)
PER_TILE, TILES = 9, (3, 1)  # image 1: two tiles and its global view; image 2: one tile


def make_model(seed: int = 0):
    config = transformers.Llama4Config(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE,
                                       boi_token_index=START, eoi_token_index=END, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = transformers.Llama4ForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight drawn (transformers' init zeroes biases, keeps norms at 1)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias") or p.ndim == 1 or "embed" in name or "positional" in name:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * p.shape[-2 if "experts" in name else 1] ** -0.5)
    return model


def image_batch():
    """ids [2, 56]: row 0 text, image 1 (27 placeholders), text, image 2 (9), text; row 1 text alone; pixels."""
    rng = np.random.default_rng(1)
    text = lambda n: list(rng.integers(0, 280, n))  # noqa: E731
    row0 = text(3) + [START] + [IMAGE] * PER_TILE * TILES[0] + [END] + text(2) + [START] + [IMAGE] * PER_TILE \
        + [END] + text(11)
    ids = np.array([row0, text(len(row0))], np.int32)
    pixels = rng.standard_normal((sum(TILES), 3, 48, 48)).astype(np.float32)
    return ids, pixels


def hf_logits(model, ids, pixels=None):
    """transformers' logits, those of Llama4ForConditionalGeneration.forward's language model call (5.24's forward
    then fails building its output: MoeCausalLMOutputWithPast has no image_outputs)."""
    kwargs = {} if pixels is None else {"pixel_values": torch.from_numpy(pixels)}
    seen = []
    hook = model.language_model.register_forward_hook(lambda module, args, out: seen.append(out.logits))
    try:
        with torch.no_grad():
            return model(input_ids=torch.from_numpy(ids.astype(np.int64)), **kwargs).logits.float().numpy()
    except AttributeError as e:
        if "image_outputs" not in str(e):
            raise
        return seen[-1].float().numpy()
    finally:
        hook.remove()


def ours(config, params, ids, pixels=None, pad_to=None):
    """Our float32 logits, with the tiles' inputs where there are pixels."""
    positions, images = text_positions(ids), None
    if pixels is not None:
        positions, images = llama4.model_inputs(config, ids, pixels, pad_to)
    return forward(config, params, ids, positions, images)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama4")
    model = make_model()
    return model, tmp, import_tiny(model, tmp)


def test_imports_the_tower_and_matches_transformers_with_images_and_text_alone(imported):
    model, tmp, keys = imported
    assert keys["decoder_block"] == "llama4" and keys["image_token_id"] == IMAGE
    assert keys["chunk_attn_window_size"] == 8 and keys["nope_layer_interval"] == 3 and keys["decoder_sparse_step"] == 2
    config, params = load(tmp / "out")
    assert set(params) >= {"vision", "layers", "token_embedding"}
    ids, pixels = image_batch()
    theirs = hf_logits(model, ids, pixels)
    with_images = relative_error(ours(config, params, ids, pixels), theirs)
    text_ids = np.random.default_rng(2).integers(0, 280, ids.shape).astype(np.int32)
    text_alone = relative_error(ours(config, params, text_ids), hf_logits(model, text_ids))
    # Measured 2026-11-30 (CPU, float32, seed 0): 1.11e-6 with images, 1.03e-6 text alone.
    print(f"llama4: relative logits error with images {with_images:.2e}, text alone {text_alone:.2e}")
    assert with_images <= 1e-5 and text_alone <= 1e-5, (with_images, text_alone)
    # the control: the tiles in the other order move the logits at and after the images
    assert relative_error(ours(config, params, ids, pixels[[1, 0, 2, 3]]), theirs) > 1e-3


@pytest.mark.slow  # a second compile of the forward (10-20 s on 2 loaded cores, 2026-11-30)
def test_padded_tiles_give_the_same_logits(imported):
    """Tiles padded to a fixed count (one compile for every batch) change nothing."""
    _, tmp, _ = imported
    config, params = load(tmp / "out")
    ids, pixels = image_batch()
    np.testing.assert_allclose(ours(config, params, ids, pixels, pad_to=6), ours(config, params, ids, pixels),
                               rtol=0, atol=1e-5)


def test_export_loads_in_transformers_as_the_same_model(imported):
    model, tmp, _ = imported
    reloaded = export_and_reload(tmp, transformers, torch, "Llama4ForConditionalGeneration")
    ids, pixels = image_batch()
    assert relative_error(hf_logits(reloaded, ids, pixels), hf_logits(model, ids, pixels)) == 0.0


def test_export_of_the_keys_alone_is_transformers_config(imported):
    """to_hf_config from the model keys (no original config.json to copy) builds the same transformers model."""
    model, _, keys = imported
    written = llama4.MODEL.to_hf_config(keys)
    rebuilt = transformers.Llama4Config(**written)
    assert llama4.MODEL.from_hf_config(rebuilt.to_dict()) == llama4.MODEL.from_hf_config(model.config.to_dict())


@pytest.mark.slow  # check_logits builds the model from its checkpoint (10-20 s on 2 loaded cores, 2026-11-30)
def test_check_logits_reads_pixel_values_from_the_golden_file(imported, capsys):
    model, tmp, _ = imported
    ids, pixels = image_batch()
    golden = tmp / "golden.npz"
    np.savez(golden, input_ids=ids, logits=hf_logits(model, ids, pixels), pixel_values=pixels)
    assert check_logits.main([str(tmp / "out"), "--golden", str(golden)]) == 0
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) <= 1e-5
    # --hf: transformers' Llama4ForCausalLM (AutoModelForCausalLM reads the language model of the directory) on text
    assert check_logits.main([str(tmp / "out"), "--hf", str(tmp / "hf"), "--length", "16"]) == 0
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) <= 1e-5
    wrong = tmp / "wrong.npz"
    np.savez(wrong, input_ids=ids, logits=hf_logits(model, ids, pixels), pixel_values=pixels,
             image_grid_thw=np.ones((2, 3)))
    with pytest.raises(check_logits.CheckError, match="image_grid_thw.*forward arguments"):
        check_logits.main([str(tmp / "out"), "--golden", str(wrong)])


def test_placeholders_that_do_not_match_the_tiles_are_refused(imported):
    _, tmp, _ = imported
    config, _ = load(tmp / "out")
    ids, pixels = image_batch()
    with pytest.raises(ValueError, match="27 tokens"):
        llama4.model_inputs(config, ids, pixels[:3])
    with pytest.raises(ValueError, match=r"must be tiles \[tiles, 3, 48, 48\]"):
        llama4.model_inputs(config, ids, pixels[:, :, :40])


@pytest.mark.slow  # a second import and compile (10-20 s on 2 loaded cores, 2026-11-30)
def test_text_only_import_keeps_the_language_model(imported, tmp_path):
    model, tmp, _ = imported
    notes = []
    keys = convert.import_hf(str(tmp / "hf"), str(tmp_path / "text"), log=notes.append, text_only=True)
    assert keys["decoder_block"] == "llama4_text" and sum("text decoder" in n for n in notes) == 1, notes
    config, params = load(tmp_path / "text")
    text_ids = np.random.default_rng(2).integers(0, 280, (2, 24)).astype(np.int32)
    assert relative_error(ours(config, params, text_ids), hf_logits(model, text_ids)) <= 1e-5

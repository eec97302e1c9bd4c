"""The gemma4 family against transformers' Gemma4ForConditionalGeneration in float32: a tiny random model (per-layer
inputs, keys as values, the MoE block, sliding and full layers; a 2-layer vision tower pooling 2 x 2) saved with
save_pretrained, imported with its tower, checked with check_logits on a golden file holding pixel_values and
image_position_ids (two images of different aspect ratios in one row, a video placeholder in the other), on text
alone, with the images padded to more of them, and against a control (the soft tokens scaled); the export loaded back
by transformers as the same class with the same logits; decoding from an image prompt as transformers' generate;
--text-only; one-line refusals."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from vlm_helpers import export_and_reload, forward, import_tiny, load, relative_error, text_positions
from maxtrain import check_logits
from maxtrain.checkpointing import convert
from maxtrain.data import images as images_lib
from maxtrain.models import sampling
from maxtrain.models.families import gemma4
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")
pytest.importorskip("PIL")

VOCAB, IMAGE, BOI, EOI, VIDEO, AUDIO = 300, 290, 288, 289, 291, 292
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, vocab_size=VOCAB,
            vocab_size_per_layer_input=VOCAB, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
            hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=24, final_logit_softcapping=5.0)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=40)
SPEC = images_lib.Gemma4VisionPreprocess(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)


def make_config():
    return transformers.Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None, image_token_id=IMAGE,
                                     boi_token_id=BOI, eoi_token_id=EOI, video_token_id=VIDEO, audio_token_id=AUDIO)


def make_model(seed: int = 0):
    config = make_config()
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight drawn; q/k norm scales below 1 keep the unscaled scores moderate
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(0.4 + 0.1 * noise if ("q_norm" in name or "k_norm" in name)
                    else 1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    return model


def image_batch():
    """ids [2, T]: row 0 text, image 1, text, image 2, text; row 1 text with a video placeholder; the images'
    pixel_values [2, 280, 48] and image_position_ids [2, 280, 2] as the processor makes them."""
    rng = np.random.default_rng(1)
    done = [images_lib.gemma4(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), SPEC) for h, w in ((30, 130), (95, 40))]
    text = lambda n: list(rng.integers(0, 280, n))  # noqa: E731
    row0 = (text(3) + [BOI] + [IMAGE] * done[0].num_tokens + [EOI] + text(2) + [BOI] + [IMAGE] * done[1].num_tokens
            + [EOI] + text(3))
    row1 = text(4) + [VIDEO] + text(len(row0) - 5)
    return (np.array([row0, row1], np.int32), np.stack([d.pixel_values for d in done]),
            np.stack([d.position_ids for d in done]))


def hf_logits(model, ids, pixels=None, positions=None):
    kwargs = {} if pixels is None else dict(pixel_values=torch.from_numpy(pixels),
                                            image_position_ids=torch.from_numpy(positions.astype(np.int64)))
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids.astype(np.int64)), **kwargs).logits.float().numpy()


def last_float(capsys) -> float:
    return float(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma4_vl")
    model = make_model()
    return model, tmp, import_tiny(model, tmp)


@pytest.mark.slow  # ~70 s on the shared 2-core machine: the import and four compiles of the model with its tower
def test_imports_the_tower_and_check_logits_matches_transformers_with_images(imported, capsys):
    model, tmp, keys = imported
    assert keys["decoder_block"] == "gemma4" and keys["image_token_id"] == IMAGE and keys["num_experts"] == 4
    ids, pixels, positions = image_batch()
    theirs = hf_logits(model, ids, pixels, positions)
    golden = tmp / "golden.npz"
    np.savez(golden, input_ids=ids, logits=theirs, pixel_values=pixels, image_position_ids=positions)
    assert check_logits.main([str(tmp / "out"), "--golden", str(golden)]) == 0
    with_images = last_float(capsys)
    text = np.random.default_rng(2).integers(0, 280, (2, 24)).astype(np.int32)
    np.savez(tmp / "text.npz", input_ids=text, logits=hf_logits(model, text))
    assert check_logits.main([str(tmp / "out"), "--golden", str(tmp / "text.npz")]) == 0
    text_alone = last_float(capsys)
    print(f"gemma4: relative logits error with images {with_images:.2e}, text alone {text_alone:.2e}")
    assert with_images <= 1e-5 and text_alone <= 1e-5, (with_images, text_alone)
    # the control: the soft tokens scaled (as the text embeddings are) is not transformers' model
    config, params = load(tmp / "out")
    scaled = {**params, "vision": {**params["vision"], "projection": params["vision"]["projection"] * 8.0}}
    _, images = gemma4.model_inputs(config, ids, pixels, positions)
    assert relative_error(ours(config, scaled, ids, images), theirs) > 1e-3
    # padded to four images (two of them all padding): the same logits
    _, padded = gemma4.model_inputs(config, ids, pixels, positions, pad_to=4)
    assert padded["pixel_values"].shape[0] == 4
    assert relative_error(ours(config, params, ids, padded), theirs) <= 1e-5


def ours(config, params, ids, images):
    """Our float32 logits for these params (check_logits' forward reads its params from the checkpoint)."""
    return forward(config, params, ids, text_positions(ids), images)


@pytest.mark.slow  # the module's import fixture (~15 s)
def test_export_loads_in_transformers_as_the_same_model(imported):
    model, tmp, _ = imported
    reloaded = export_and_reload(tmp, transformers, torch, "Gemma4ForConditionalGeneration")
    ids, pixels, positions = image_batch()
    assert relative_error(hf_logits(reloaded, ids, pixels, positions), hf_logits(model, ids, pixels, positions)) == 0


@pytest.mark.slow  # the module's import fixture (~15 s)
def test_text_only_import_keeps_the_language_model_and_says_so_once(imported, tmp_path):
    _, tmp, _ = imported
    notes = []
    keys = convert.import_hf(str(tmp / "hf"), str(tmp_path / "text"), log=notes.append, text_only=True)
    assert keys["decoder_block"] == "gemma4_text" and sum("text decoder" in n for n in notes) == 1, notes


def test_bad_inputs_are_refused_in_one_line():
    """On the host, before any compile: placeholders that do not match the images' soft tokens, arrays of the wrong
    layout, and a checkpoint whose every token attends both ways."""
    hf = make_config().to_dict()
    config = convert.spec_config(convert.model_keys(hf))
    assert config.decoder_block == "gemma4" and config.image_token_id == IMAGE
    # the config written from the model keys alone (an export after changed settings) reads back the same
    assert convert.model_keys(transformers.Gemma4Config(**gemma4.to_hf_config(vars(config))).to_dict()) == vars(config)
    ids, pixels, positions = image_batch()
    _, images = gemma4.model_inputs(config, ids, pixels, positions, pad_to=3)
    assert images["pixel_values"].shape == (3, 280, 48) and (images["image_position_ids"][2] == -1).all()
    ids[0, 5] = 7  # one placeholder fewer
    with pytest.raises(ValueError, match="placeholders"):
        gemma4.model_inputs(config, ids, pixels, positions)
    with pytest.raises(ValueError, match="image_position_ids"):
        gemma4.model_inputs(config, ids, pixels, positions[:, :, :1])
    hf["text_config"]["use_bidirectional_attention"] = "all"  # "vision": test_gemma4_bidirectional*.py
    with pytest.raises(convert.ConversionError, match="use_bidirectional_attention='all'.*None or 'vision'"):
        convert.model_keys(hf)


@pytest.mark.slow  # the module's import fixture and a gradient's compile
def test_a_training_step_reaches_the_tower(imported):
    """The loss's gradient with images reaches the encoder's patch embedding and the projector."""
    _, tmp, _ = imported
    config, params = load(tmp / "out")
    model, rt = Model.bind(config), Runtime.from_config(config)
    ids, pixels, positions = image_batch()
    _, images = gemma4.model_inputs(config, ids, pixels, positions, pad_to=3)
    batch = {"inputs": ids, "targets": np.roll(ids, -1, axis=1),
             "positions": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape),
             "segment_ids": np.ones_like(ids), "loss_weights": np.ones(ids.shape, np.float32), **images}
    grads = jax.jit(jax.grad(lambda p, b: model.loss_fn(p, b, rt)[0]))(params, batch)
    assert float(np.abs(grads["vision"]["patch_embed"]).max()) > 0
    assert float(np.abs(grads["vision"]["projection"]).max()) > 0


@pytest.mark.slow  # the module's import fixture, the decoding loop's compile and transformers' generate (~30 s)
def test_decoding_from_an_image_prompt_is_transformers_generate(imported):
    """maxtrain.decode's path (the prompt's image, boi and eoi around its soft tokens, the tower in the prefill, the
    cache after it) against Gemma4ForConditionalGeneration.generate on the same weights and pixels: the prefill's
    logits (transformers' first step) within float32 tolerance and the same greedy tokens; another image (the
    control) gives other logits."""
    model, tmp, _ = imported
    config, params = load(tmp / "out")
    ours_model, rt = Model.bind(config), Runtime.from_config(config)
    rng = np.random.default_rng(3)
    _, pixels, positions = image_batch()
    n = int(np.all(positions[0] != -1, axis=-1).sum()) // 4  # its soft tokens: real patches pooled 2 x 2
    prompt = [int(t) for t in rng.integers(0, 280, 4)] + [BOI] + [IMAGE] * n + [EOI] + [11, 42, 7]
    ids = np.array([prompt], np.int32)
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.from_numpy(ids.astype(np.int64)),
                                pixel_values=torch.from_numpy(pixels[:1]),
                                image_position_ids=torch.from_numpy(positions[:1].astype(np.int64)), max_new_tokens=4,
                                do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    their_tokens = [int(t) for t in theirs.sequences[0, len(prompt):]]
    their_first = theirs.logits[0].float().numpy()                                       # [1, V]

    def prefill(pixel_values):
        text_positions_, images = gemma4.model_inputs(config, ids, pixel_values, positions[:1])
        cache = ours_model.init_cache(1, len(prompt) + 4, rt.dtype)
        with jax.default_matmul_precision("highest"):
            logits, _ = ours_model.forward_with_cache(params, ids, text_positions_, cache, 0, rt, images=images)
        return np.asarray(logits)[:, -1], text_positions_, images

    first, text_positions_, images = prefill(pixels[:1])
    with jax.default_matmul_precision("highest"):
        new = sampling.generate(params, prompt, ours_model, rt, max_new_tokens=4, images=images,
                                positions=text_positions_)
    assert relative_error(first, their_first) <= 1e-5, relative_error(first, their_first)
    assert new == their_tokens, (new, their_tokens)
    other = prefill(pixels[:1][:, ::-1].copy())[0]  # the same patches in reverse: another image
    assert relative_error(other, their_first) > 1e-3

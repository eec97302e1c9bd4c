"""Gemma 4 with use_bidirectional_attention "vision" against transformers' Gemma4ForConditionalGeneration in float32
(given the processor's mm_token_type_ids: an image's tokens attend to each other both ways in the sliding layers): a
tiny random model saved with save_pretrained and imported with its tower, check_logits on a golden file with two images
in a row; the control (the causal mask on the same weights, which is transformers' without mm_token_type_ids); a packed
row of two documents each with an image, per document as transformers' (its image block ending the first document),
in the plain and the banded form;
the export read back by transformers with "vision"."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vlm_helpers import export_and_reload, forward, import_tiny, load, relative_error, text_positions
from maxtrain import check_logits
from maxtrain.data import images as images_lib
from maxtrain.models.attention import image_band
from maxtrain.models.families import gemma4
from maxtrain.models.gemma4 import normed_attention
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")
pytest.importorskip("PIL")

VOCAB, IMAGE, BOI, EOI, VIDEO, AUDIO = 300, 290, 288, 289, 291, 292
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, sliding_window=6,
            hidden_size_per_layer_input=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=5.0,
            use_bidirectional_attention="vision")
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=40)
SPEC = images_lib.Gemma4VisionPreprocess(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)


def make_model():
    config = transformers.Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None, image_token_id=IMAGE,
                                       boi_token_id=BOI, eoi_token_id=EOI, video_token_id=VIDEO,
                                       audio_token_id=AUDIO)
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight drawn; q/k norm scales below 1 keep the unscaled scores moderate
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(0.4 + 0.1 * noise if ("q_norm" in name or "k_norm" in name)
                    else 1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    return model


def images(sizes, seed=1):
    rng = np.random.default_rng(seed)
    done = [images_lib.gemma4(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), SPEC) for h, w in sizes]
    return done, np.stack([d.pixel_values for d in done]), np.stack([d.position_ids for d in done])


def hf_logits(model, ids, pixels, positions, bidirectional=True):
    """transformers' logits; with bidirectional, given mm_token_type_ids as Gemma4Processor makes them."""
    ids = ids.astype(np.int64)
    types = np.where(ids == IMAGE, 1, np.where(ids == VIDEO, 2, 0))
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(pixels),
                     image_position_ids=torch.from_numpy(positions.astype(np.int64)),
                     mm_token_type_ids=torch.from_numpy(types) if bidirectional else None).logits.float().numpy()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma4_bidirectional")
    model = make_model()
    keys = import_tiny(model, tmp)
    assert keys["bidirectional_image_attention"] is True
    return model, tmp


@pytest.mark.slow  # ~40 s on the shared 2-core machine: the import and three compiles of the model with its tower
def test_check_logits_matches_transformers_with_an_image_both_ways(imported, capsys):
    model, tmp = imported
    rng = np.random.default_rng(2)
    done, pixels, positions = images([(16, 40), (24, 16)])
    text = lambda n: list(rng.integers(0, 280, n))  # noqa: E731
    row0 = (text(3) + [BOI] + [IMAGE] * done[0].num_tokens + [EOI] + text(2) + [BOI] + [IMAGE] * done[1].num_tokens
            + [EOI] + text(3))
    row1 = text(4) + [VIDEO] + text(len(row0) - 5)
    ids = np.array([row0, row1], np.int32)
    theirs = hf_logits(model, ids, pixels, positions)
    np.savez(tmp / "golden.npz", input_ids=ids, logits=theirs, pixel_values=pixels, image_position_ids=positions)
    assert check_logits.main([str(tmp / "out"), "--golden", str(tmp / "golden.npz")]) == 0
    error = float(capsys.readouterr().out.strip().splitlines()[-1])
    print(f"gemma4 bidirectional images: relative logits error {error:.2e}")
    assert error <= 1e-5
    # the control: the causal mask on the same weights is another model (transformers' without mm_token_type_ids)
    config, params = load(tmp / "out")
    causal = config.replace(bidirectional_image_attention=False)
    _, padded = gemma4.model_inputs(config, ids, pixels, positions)
    ours_causal = forward(causal, params, ids, text_positions(ids), padded)
    assert relative_error(ours_causal, theirs) > 1e-3
    assert relative_error(ours_causal, hf_logits(model, ids, pixels, positions, bidirectional=False)) <= 1e-5


@pytest.mark.slow  # the module's import fixture and a forward's compile
def test_a_packed_row_of_two_documents_with_images_is_each_document_as_transformers(imported, monkeypatch):
    """Document 1 ends with its image's soft tokens, document 2 starts with its own: the two runs of image tokens
    stay apart, and each document's logits are transformers' for it alone (the control: causal ones differ); the
    training loss on the row is the cross-entropy of transformers' logits, its gradient reaching the tower."""
    model, tmp = imported
    rng = np.random.default_rng(3)
    done, pixels, positions = images([(16, 24), (16, 16)], seed=4)
    doc1 = list(rng.integers(0, 280, 4)) + [BOI] + [IMAGE] * done[0].num_tokens
    doc2 = [IMAGE] * done[1].num_tokens + [EOI] + list(rng.integers(0, 280, 5))
    theirs = [hf_logits(model, np.array([d], np.int32), pixels[i:i + 1], positions[i:i + 1])[0]
              for i, d in enumerate((doc1, doc2))]
    config, params = load(tmp / "out")
    ids = np.array([doc1 + doc2 + [0] * 3], np.int32)
    segments = np.array([[1] * len(doc1) + [2] * len(doc2) + [0] * 3], np.int32)
    pos = np.array([list(range(len(doc1))) + list(range(len(doc2))) + [0] * 3], np.int32)
    _, padded = gemma4.model_inputs(config, ids, pixels, positions)

    def packed(config):
        model_ours, rt = Model.bind(config), Runtime.from_config(config)
        with jax.default_matmul_precision("highest"):
            return np.asarray(jax.jit(lambda p, i: model_ours.forward(p, jnp.asarray(ids), jnp.asarray(pos),
                                                                      jnp.asarray(segments), rt, images=i)[0])(
                params, padded))[0]

    ours, causal, n = packed(config), packed(config.replace(bidirectional_image_attention=False)), len(doc1)
    assert relative_error(ours[:n], theirs[0]) <= 1e-5
    assert relative_error(ours[n:n + len(doc2)], theirs[1]) <= 1e-5
    assert relative_error(causal[:n], theirs[0]) > 1e-3 and relative_error(causal[n:n + len(doc2)], theirs[1]) > 1e-3
    # the sliding layer banded (models/attention/image_band.py: 8-query blocks here, the span the longest image)
    span = max(d.num_tokens for d in done)
    monkeypatch.setattr(normed_attention, "IMAGE_BAND_BLOCK", 8)
    assert image_band.use_band(ids.shape[1], config.sliding_window_size, span, 8)
    banded = packed(config.replace(image_attention_span=span))
    assert relative_error(banded[:n], theirs[0]) <= 1e-5 and relative_error(banded[n:n + len(doc2)], theirs[1]) <= 1e-5
    # a training step's loss on the packed row: the cross-entropy of transformers' logits, document by document
    targets = np.roll(ids, -1, axis=1)
    weights = (segments > 0).astype(np.float32)
    weights[0, n - 1] = weights[0, n + len(doc2) - 1] = 0.0  # each document's last token predicts nothing of it
    batch = {"inputs": ids, "targets": targets, "positions": pos, "segment_ids": segments, "loss_weights": weights,
             **padded}
    model_ours, rt = Model.bind(config), Runtime.from_config(config)
    with jax.default_matmul_precision("highest"):
        (loss, _), grads = jax.jit(jax.value_and_grad(lambda p, b: model_ours.loss_fn(p, b, rt)[:2],
                                                      has_aux=True))(params, batch)
    logits = np.concatenate([theirs[0], theirs[1], np.zeros((3, theirs[0].shape[-1]), np.float32)])
    peak = logits.max(-1, keepdims=True)
    nll = np.log(np.exp(logits - peak).sum(-1)) + peak[:, 0] - logits[np.arange(len(logits)), targets[0]]
    assert abs(float(loss) - float((nll * weights[0]).sum())) <= 1e-5 * float((nll * weights[0]).sum())
    assert float(np.abs(grads["vision"]["patch_embed"]).max()) > 0


@pytest.mark.slow  # the module's import fixture
def test_the_export_writes_vision_back(imported):
    model, tmp = imported
    reloaded = export_and_reload(tmp, transformers, torch, "Gemma4ForConditionalGeneration")
    assert reloaded.config.text_config.use_bidirectional_attention == "vision"
    done, pixels, positions = images([(16, 24)])
    ids = np.array([[5, 6, BOI] + [IMAGE] * done[0].num_tokens + [EOI, 7, 8]], np.int32)
    assert relative_error(hf_logits(reloaded, ids, pixels, positions), hf_logits(model, ids, pixels, positions)) == 0

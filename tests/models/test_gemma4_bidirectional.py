"""Gemma 4's use_bidirectional_attention "vision" (the gemma4 family's bidirectional_image_attention) without torch:
the image blocks as transformers numbers them (runs of image or video placeholders, boi and eoi outside, never across
documents), the mask against a loop over every (query, key) pair, the config read and written back, the refusals
(import of "all"; a kernel or context parallelism for the sliding layers) and decoding from an image prompt, whose
prefill and greedy steps are the full forward's with the same mask (the control: the causal mask differs). Against
transformers: test_gemma4_bidirectional_hf.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from gemma4_image_helpers import PROCESSOR, TEXT, VISION
from maxtrain.checkpointing import convert
from maxtrain.config import load_config
from maxtrain.errors import ConfigError
from maxtrain.models import attention, sampling
from maxtrain.models.families import gemma4
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime

BOI, IMAGE, EOI, VIDEO = 300, 301, 302, 303
HF = {"text_config": {**TEXT, "use_bidirectional_attention": "vision"}, "vision_config": VISION,
      "image_token_id": IMAGE, "boi_token_id": BOI, "eoi_token_id": EOI, "video_token_id": VIDEO}


def tiny_config(*extra, bidirectional=True):
    keys = {**gemma4.from_hf_config(HF), "bidirectional_image_attention": bidirectional}
    return load_config([BASE_YML, "decoder_block=gemma4", *[f"{k}={v}" for k, v in keys.items()],
                        "max_target_length=128", "dtype=float32",
                        "weight_dtype=float32", *extra])


def test_blocks_number_each_run_of_placeholders_within_its_document():
    config = tiny_config("attention=dot_product")
    t = [5, BOI, IMAGE, IMAGE, EOI, 6, VIDEO, VIDEO, 7, IMAGE, IMAGE, IMAGE, 8]
    seg = [1] * 10 + [2] * 3  # the third run is split by the document boundary
    got = np.asarray(gemma4.blocks(jnp.array([t]), jnp.array([seg]), config))[0]
    assert got.tolist() == [-1, -1, 0, 0, -1, -1, 1, 1, -1, 2, 3, 3, -1]
    assert gemma4.blocks(jnp.array([t]), jnp.array([seg]), tiny_config(bidirectional=False)) is None


def test_the_mask_is_causal_or_same_block_within_the_window_and_the_segment():
    rng = np.random.default_rng(0)
    seg = np.array([[1] * 9 + [2] * 7, [1] * 13 + [0] * 3])
    blocks = np.where(rng.random((2, 16)) < 0.5, rng.integers(0, 3, (2, 16)), -1)
    got = np.asarray(attention.make_attention_mask(jnp.array(seg), jnp.array(seg), sliding_window=4,
                                                   q_blocks=jnp.array(blocks), kv_blocks=jnp.array(blocks)))
    for b in range(2):
        for t in range(16):
            for s in range(16):  # transformers: AND(kv > q - W, OR(kv <= q, same block >= 0)), and one document
                both = blocks[b, t] == blocks[b, s] and blocks[b, t] >= 0
                assert got[b, t, s] == (seg[b, t] == seg[b, s] and (s <= t or both) and s > t - 4), (b, t, s)
    assert got.any(axis=-1).all() and (got & ~np.tril(np.ones((16, 16), bool))).any()  # some key after its query


def test_the_config_reads_and_writes_back_and_all_is_refused():
    keys = gemma4.from_hf_config(HF)
    assert keys["bidirectional_image_attention"] is True
    assert gemma4.to_hf_config(keys)["text_config"]["use_bidirectional_attention"] == "vision"
    assert gemma4.to_hf_config({**keys, "bidirectional_image_attention": False}
                               )["text_config"]["use_bidirectional_attention"] is None
    causal = {**HF, "text_config": TEXT}
    assert gemma4.from_hf_config(causal)["bidirectional_image_attention"] is False
    with pytest.raises(convert.ConversionError, match="use_bidirectional_attention='all'.*None or 'vision'"):
        gemma4.from_hf_config({**HF, "text_config": {**TEXT, "use_bidirectional_attention": "all"}})
    # the text decoder alone (--text-only) reads "vision" as causal: it has no image tokens
    text = convert.model_keys({"model_type": "gemma4", **HF}, text_only=True)
    assert text["decoder_block"] == "gemma4_text"


def test_a_model_without_a_tower_refuses_the_setting_that_would_do_nothing():
    with pytest.raises(ConfigError, match="bidirectional_image_attention=true does nothing without a model with a "
                                          "vision tower.*vision_config=.*drop bidirectional_image_attention"):
        load_config([BASE_YML, "decoder_block=gemma4", "sliding_window_size=64", "bidirectional_image_attention=true"])
    assert tiny_config().bidirectional_image_attention  # with the tower: read


def test_a_kernel_or_context_parallelism_for_the_sliding_layers_is_refused_before_compiling():
    with pytest.raises(ValueError, match="bidirectional_image_attention.*sliding-window layers.*attention=flash"):
        runtime(tiny_config("attention=flash"))
    with pytest.raises(ValueError, match="not attention=dot_product with 2-way context parallelism"):
        runtime(tiny_config("attention=dot_product"), context_parallel=2)
    rt = runtime(tiny_config("attention=autoselected"))
    sliding = [k for k in rt.attention_kinds if k.window]  # the full-attention layers keep a kernel: causal there
    assert [(k.implementation, "bidirectional_image_attention" in k.reason) for k in sliding] == [("dot_product", True)]
    assert "bidirectional" not in " ".join(k.reason for k in rt.attention_kinds if not k.window)


def runtime(config, **kw):
    """The runtime a run resolves (training/builder.py): per layer kind, on the GPU when the test names one."""
    return Runtime.from_config(config, backend="gpu", layer_types=Model.bind(config).layer_types, **kw)


class Pieces:
    @staticmethod
    def piece(i):
        return {IMAGE: "<image_soft_token>"}.get(i, f"<{i}>")


@pytest.mark.slow  # the decoding loop, the tower and three forwards compile in ~40 s on two shared cores
def test_decoding_from_an_image_prompt_is_the_full_forward_with_the_image_both_ways(tmp_path):
    # deferred: PIL is an optional extra
    from PIL import Image  # pylint: disable=import-outside-toplevel

    from maxtrain.data import image_prompts  # pylint: disable=import-outside-toplevel

    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    config = tiny_config("attention=dot_product", f"prompt_image={path}", f"tokenizer_path={tmp_path}")
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.PRNGKey(0))
    ids, arrays = image_prompts.prompt_with_image(config, Pieces, [5, 17, 42, IMAGE, 7, 99, 3])
    positions, images = model.family.vision.inputs_named(config, np.array([ids]), arrays)
    causal = Model.bind(config.replace(bidirectional_image_attention=False))
    with jax.default_matmul_precision("highest"):
        prefill, _ = model.forward_with_cache(params, jnp.array([ids]), jnp.asarray(positions),
                                              model.init_cache(1, 96, jnp.float32), 0, rt, images=images)
        new = sampling.generate(params, ids, model, rt, max_new_tokens=5, images=images, positions=positions)
        row = jnp.array([ids + new[:-1]])
        full = jnp.arange(row.shape[1])[None]
        logits, _ = model.forward(params, row, full, jnp.ones_like(row), rt, images=images)
        control, _ = causal.forward(params, row, full, jnp.ones_like(row), Runtime.from_config(causal.config),
                                    images=images)
    logits, control, prefill = np.asarray(logits)[0], np.asarray(control)[0], np.asarray(prefill)[0]
    scale = np.max(np.abs(logits))
    assert np.max(np.abs(prefill - logits[:len(ids)])) / scale <= 1e-5
    assert new == [int(t) for t in np.argmax(logits[len(ids) - 1:], axis=-1)]
    image = ids.index(IMAGE)
    assert np.max(np.abs(control[:image] - logits[:image])) / scale <= 1e-5  # before the image: causal either way
    assert np.max(np.abs(control[image:] - logits[image:])) / scale > 1e-3

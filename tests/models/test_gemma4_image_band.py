"""The banded form of Gemma 4's bidirectional image attention (models/attention/image_band.py) against the plain form
over the whole mask: values and gradients on rows with several images, packed documents, padding and a soft cap; the
controls (the causal mask, an image longer than the span: both differ); the model's sliding layers taking the banded
form and matching the plain one; the host's refusal of an image run longer than image_attention_span."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import attention
from maxtrain.models.attention import image_band
from maxtrain.models.families import gemma4
from maxtrain.models.gemma4 import normed_attention
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from test_gemma4_bidirectional import IMAGE, VIDEO, tiny_config

B, T, N, G, H = 2, 300, 4, 2, 8


def rows():
    """Two rows: the first two documents with four images (one runs up to the document's end, one starts the next
    document), the second one document with two images (one a video) and padding (segment 0) after it."""
    seg = np.ones((B, T), np.int32)
    seg[0, 140:] = 2
    seg[1, 250:] = 0
    blocks = -np.ones((B, T), np.int32)
    for r, (start, end) in [(0, (10, 34)), (0, (60, 71)), (0, (118, 140)), (0, (140, 160)), (0, (200, 230)),
                            (1, (30, 60)), (1, (63, 93))]:
        blocks[r, start:end] = start  # any id >= 0 per run
    return jnp.array(seg), jnp.array(blocks)


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.array(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, G, G)]


def plain(q, k, v, seg, blocks, window, cap, causal_only=False):
    kw = {} if causal_only else dict(q_blocks=blocks, kv_blocks=blocks)
    mask = attention.make_attention_mask(seg, seg, sliding_window=window, **kw)
    return attention.dot_product_attention(q, k, v, mask, scale=1.0, logits_soft_cap=cap)


def banded(q, k, v, seg, blocks, window, cap, span=32, block=64):
    return image_band.image_band_attention(q, k, v, seg, blocks, sliding_window=window, span=span, block=block,
                                           scale=1.0, logits_soft_cap=cap, heads_major=True)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(a)))


@pytest.mark.parametrize("window,cap,block", [(16, 0.0, 64), (40, 5.0, 64), (16, 0.0, 128), (100, 0.0, 32)])
def test_banded_values_and_gradients_equal_the_plain_form(window, cap, block):
    q, k, v = qkv()
    seg, blocks = rows()
    cotangent = jnp.array(np.random.default_rng(1).normal(size=(B, T, N, H)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = plain(q, k, v, seg, blocks, window, cap)
        got = banded(q, k, v, seg, blocks, window, cap, block=block)
        grads = [jax.grad(lambda *x, f=f: jnp.sum(f(*x, seg, blocks, window, cap) * cotangent), argnums=(0, 1, 2))(
            q, k, v) for f in (plain, lambda *a: banded(*a, block=block))]
        causal = plain(q, k, v, seg, blocks, window, cap, causal_only=True)
    assert close(want, got)
    for a, b in zip(*grads):
        assert close(a, b)
    assert not close(causal, got, 1e-3)  # the control: a causal mask (no image both ways) differs


def test_an_image_longer_than_the_span_differs_which_is_why_the_host_refuses_it():
    q, k, v = qkv()
    seg, blocks = rows()  # its longest run is 30 tokens
    with jax.default_matmul_precision("highest"):
        want = plain(q, k, v, seg, blocks, 16, 0.0)
        assert close(want, banded(q, k, v, seg, blocks, 16, 0.0, span=30))
        assert not close(want, banded(q, k, v, seg, blocks, 16, 0.0, span=29), 1e-3)
    assert image_band.longest_run([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]]) == 3


def test_the_band_is_used_only_where_it_is_narrower_than_the_sequence():
    assert image_band.band_width(512, 1120, 512) == 511 + 512 + 1119
    assert image_band.use_band(8192, 512, 1120, 512)
    assert not image_band.use_band(2048, 512, 1120, 512)  # 2,142 keys a block: no fewer than the plain form's
    assert not image_band.use_band(8192, 0, 1120, 512)  # no window: every key behind, the plain form


def test_the_sliding_layers_run_the_banded_form_and_match_the_plain_one(monkeypatch):
    monkeypatch.setattr(normed_attention, "IMAGE_BAND_BLOCK", 64)  # 512 in a run; 64 keeps the test small
    config = tiny_config("attention=dot_product", "image_attention_span=24")
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.PRNGKey(0))
    tokens = np.random.default_rng(0).integers(0, 250, (1, 128 + 64))
    for start, end in [(5, 29), (50, 70), (120, 140)]:  # two across a block's edge
        tokens[0, start:end] = IMAGE
    tokens[0, 150:170] = VIDEO
    tokens, positions = jnp.array(tokens), jnp.arange(tokens.shape[1])[None]
    calls = []
    band = image_band.image_band_attention
    monkeypatch.setattr(image_band, "image_band_attention", lambda *a, **kw: calls.append(kw) or band(*a, **kw))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda p: model.forward(p, tokens, positions, jnp.ones_like(tokens), rt)[0])(params)
        assert [(kw["span"], kw["block"]) for kw in calls] == [(24, 64)]  # 7 + 64 + 23 keys of 192
        monkeypatch.setattr(image_band, "use_band", lambda *a: False)
        want = jax.jit(lambda p: model.forward(p, tokens, positions, jnp.ones_like(tokens), rt)[0])(params)
        causal = Model.bind(config.replace(bidirectional_image_attention=False))
        control = jax.jit(lambda p: causal.forward(p, tokens, positions, jnp.ones_like(tokens),
                                                   Runtime.from_config(causal.config))[0])(params)
    assert len(calls) == 1 and close(want, got)
    assert not close(control, got, 1e-3)


def test_an_image_run_longer_than_the_span_is_refused_on_the_host_naming_the_setting():
    config = tiny_config("attention=dot_product", "image_attention_span=64")
    tokens = np.full((1, 96), 5)
    tokens[0, 10:74] = IMAGE  # 64: served
    gemma4.check_image_runs(tokens, config)
    tokens[0, 74] = IMAGE
    with pytest.raises(ValueError, match="a run of 65 image placeholders is longer than image_attention_span=64.*"
                                         "set image_attention_span=65 or more"):
        gemma4.check_image_runs(tokens, config)
    gemma4.check_image_runs(tokens, tiny_config("attention=dot_product", bidirectional=False))  # causal: no band
    vc = gemma4.vision_config(config)  # and where the host makes a forward's image inputs (training rows, decoding)
    patches = 65 * vc.pooling_kernel_size ** 2
    grid = np.stack(np.meshgrid(np.arange(patches // 10), np.arange(10), indexing="ij"), -1).reshape(-1, 2)
    with pytest.raises(ValueError, match="image_attention_span=64"):
        gemma4.model_inputs(config, tokens, np.zeros((1, patches, vc.patch_dim)), grid[None, :patches])

"""kernels/gated_delta.py in interpret mode against models/recurrent/gated_delta.py's jnp forms (float32): forward and
gradients, packed documents, an initial state, a ragged last chunk; GPU (Triton) and TPU (Mosaic) layouts;
chunk sizes the kernel cannot take; the config choice gdn_kernel. Lowering for H100 and TPU targets:
tests/kernels/test_kernel_lowering.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import errors
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import load_config, with_overrides
from maxtrain.kernels import gated_delta as gated_delta_kernel
from maxtrain.models.recurrent import gated_delta, gated_deltanet

B, T, N, DK, DV, C = 2, 40, 2, 16, 32, 16   # 40 tokens: two whole chunks of 16 and a ragged one
SEGMENTS = np.array([[1] * 9 + [2] * 21 + [3] * 10, [4] * 40])  # boundaries inside chunks and at none


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (B, T, N, DK))) * DK**-0.5
    k = unit(jax.random.normal(ks[1], (B, T, N, DK)))
    v = jax.random.normal(ks[2], (B, T, N, DV))
    log_decay = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, N)) + 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, N)))
    s0 = jax.random.normal(ks[5], (B, N, DK, DV))
    w = jax.random.normal(ks[6], (B, T, N, DV))
    return q, k, v, log_decay, beta, jnp.asarray(SEGMENTS), s0, w


@pytest.mark.parametrize("platform, packed, block_v", [
    ("gpu", True, 16), ("tpu", True, None), pytest.param("gpu", False, None, marks=pytest.mark.slow),
    pytest.param("tpu", False, None, marks=pytest.mark.slow)])
def test_forward_matches_the_recurrent_rule(platform, packed, block_v):
    """packed: three documents in a row and an initial state; else one document from zeros. block_v 16: the GPU
    grid splits the 32 value columns in two."""
    q, k, v, a, beta, seg, s0, _ = _inputs()
    for segments, state in ([(seg, s0)] if packed else [(None, None)]):
        run = jax.jit(lambda *xs: gated_delta_kernel.forward(*xs, chunk_size=C, platform=platform, interpret=True,
                                                 block_v=block_v))
        o, s = run(q, k, v, a, beta, segments, state)
        ro, rs = gated_delta.recurrent(q, k, v, a, beta, segments, state)
        np.testing.assert_allclose(o, ro, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(s, rs, atol=2e-5, rtol=2e-5)


def _loss(fn, seg, w):
    def f(q, k, v, a, beta, s0):
        o, s = fn(q, k, v, a, beta, seg, s0)
        return jnp.sum(o * w) + jnp.sum(jnp.sin(s))
    return f


def test_gradients_equal_the_chunked_form():
    """The custom VJP's backward (through the jnp chunked form) at the kernel's inputs, and the loss itself."""
    q, k, v, a, beta, seg, s0, w = _inputs(1)
    rule = gated_delta_kernel.make(gated_delta.chunked, chunk_size=C, platform="gpu", interpret=True)
    reference = lambda *xs: gated_delta.chunked(*xs[:6], chunk_size=C, initial_state=xs[6])
    args = (q, k, v, a, beta, s0)
    value, grads = jax.jit(jax.value_and_grad(_loss(rule, seg, w), argnums=range(6)))(*args)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(_loss(reference, seg, w), argnums=range(6)))(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_gradients_equal_the_recurrent_rule(platform):
    q, k, v, a, beta, seg, s0, w = _inputs(2)
    rule = gated_delta_kernel.make(gated_delta.chunked, chunk_size=C, platform=platform, interpret=True)
    args = (q, k, v, a, beta, s0)
    grads = jax.grad(_loss(rule, seg, w), argnums=range(6))(*args)
    recurrent_grads = jax.grad(_loss(gated_delta.recurrent, seg, w), argnums=range(6))(*args)
    for g, r in zip(grads, recurrent_grads):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [0, 8, 24, 48])
def test_chunk_sizes_the_kernel_cannot_take_are_refused(chunk):
    with pytest.raises(ValueError, match=f"gdn_chunk_size={chunk} cannot run .* power of two >= 16"):
        gated_delta_kernel.check_chunk_size(chunk)
    with pytest.raises(errors.ConfigError, match="gdn_chunk_size"):
        gated_deltanet.resolve_kernel("pallas", "cpu", chunk)
    assert gated_deltanet.resolve_kernel("autoselected", "cpu", chunk) == "jnp"  # the jnp form takes any size


def test_autoselected_is_the_kernel_on_gpu_and_tpu_and_jnp_on_cpu():
    assert [gated_deltanet.resolve_kernel("autoselected", b, 64) for b in ("gpu", "tpu", "cpu")] == \
        ["pallas", "pallas", "jnp"]
    assert "Pallas Triton" in gated_deltanet.describe_kernel("pallas", "gpu")
    assert "Mosaic" in gated_deltanet.describe_kernel("pallas", "tpu")


@pytest.mark.slow  # ~15 s: the whole model twice, the kernel in interpret mode
def test_the_mixer_runs_the_kernel_when_configured():
    """A tiny Qwen3.5-shaped model (packed row) with gdn_kernel=pallas (interpret mode here) gives jnp's logits,
    and the start-up summary says which runs."""
    hybrid = ["decoder_block=qwen3_5_text", "base_num_decoder_layers=2", "inhomogeneous_layer_cycle_interval=2",
              "gdn_num_key_heads=1", "gdn_num_value_heads=2", "gdn_key_head_dim=16", "gdn_value_head_dim=16",
              "gdn_chunk_size=16", "partial_rotary_factor=0.5", "max_new_tokens=0"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, 256, (1, 40)))
    segments = jnp.asarray(SEGMENTS[:1])
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in (9, 21, 10)])[None])
    logits = {}
    for choice in ("jnp", "pallas"):
        cfg = load_config([BASE_YML, *with_overrides(with_overrides(TINY, *hybrid), f"gdn_kernel={choice}")])
        rt = Runtime.from_config(cfg, backend="cpu")
        assert rt.gdn_kernel == choice
        assert ("interpret mode on cpu" in rt.describe()) == (choice == "pallas")
        params = Model.bind(cfg).init_params(jax.random.key(0))
        logits[choice] = jax.jit(lambda p, cfg=cfg, rt=rt: Model.bind(cfg).forward(p, tokens, positions, segments, rt)[0])(
            params)
    np.testing.assert_allclose(logits["pallas"], logits["jnp"], atol=2e-5, rtol=2e-5)


def test_head_widths_the_gpu_kernel_cannot_take():
    """Triton wants powers of two >= 16: autoselected keeps jnp on such a GPU model, pallas is refused; TPU takes any."""
    assert gated_deltanet.resolve_kernel("autoselected", "gpu", 64, 96, 128) == "jnp"
    assert gated_deltanet.resolve_kernel("autoselected", "tpu", 64, 96, 128) == "pallas"
    with pytest.raises(errors.ConfigError, match="gdn_key_head_dim=96 must be powers of two >= 16 .*gdn_kernel=jnp"):
        gated_deltanet.resolve_kernel("pallas", "gpu", 64, 96, 128)

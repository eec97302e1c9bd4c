"""`attention: autoselected | dot_product | flash | cudnn`: what may run where, and what the user is told."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.models import attention
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import load_config, with_overrides


@pytest.mark.parametrize("backend, expected", [("cpu", "dot_product"), ("gpu", "cudnn"), ("cuda", "cudnn"),
                                               ("tpu", "flash")])
def test_autoselected_picks_per_backend(backend, expected):
    assert attention.resolve_implementation("autoselected", backend) == expected


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_autoselected_flash_covers_windows_and_soft_caps(backend):
    """The kernels implement sliding windows and soft-caps, so Gemma-style models keep flash."""
    assert attention.resolve_implementation("autoselected", backend, sliding_window=4096, logits_soft_cap=50.0) == "flash"
    assert attention.resolve_implementation("flash", backend, sliding_window=4096, logits_soft_cap=50.0) == "flash"


def test_cudnn_refuses_soft_caps_it_lacks():
    assert attention.resolve_implementation("cudnn", "gpu", dtype=jnp.bfloat16, sliding_window=512) == "cudnn"
    with pytest.raises(ValueError, match="attention=cudnn does not implement logits_soft_cap=50.0.*attention=flash"):
        attention.resolve_implementation("cudnn", "gpu", dtype=jnp.bfloat16, logits_soft_cap=50.0)


def test_kernels_need_an_explicit_platform():
    """The platform is passed down, never guessed from the compiling machine's default backend."""
    q = jnp.zeros((1, 16, 2, 16))
    seg = jnp.ones((1, 16), jnp.int32)
    with pytest.raises(ValueError, match="attention=flash needs platform="):
        attention.attention(q, q, q, seg, implementation="flash")
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        attention.resolve_implementation("flash", "metal")


@pytest.mark.parametrize("name, backend, kwargs, message", [
    ("cudnn", "cpu", {}, r"attention=cudnn needs an NVIDIA GPU, but the platform is 'cpu'.*attention=flash, dot_product"),
    ("cudnn", "tpu", {}, r"needs an NVIDIA GPU"),
    ("cudnn", "gpu", {"dtype": jnp.float32}, r"attention=cudnn needs dtype=bfloat16 or float16.*float32"),
    ("cudnn", "gpu", {"dtype": jnp.bfloat16, "head_dim": 12}, r"multiple of 8 .*head_dim=12"),
    ("cudnn", "gpu", {"dtype": jnp.bfloat16, "head_dim": 512}, r"at most 256"),
    ("splash", "cpu", {}, r"attention='splash' is not one of autoselected, dot_product, flash, cudnn, tokamax"),
    ("tokamax", "cpu", {}, r"attention=tokamax needs an NVIDIA GPU, but the platform is 'cpu'"),
    ("tokamax", "gpu", {"sinks": True}, r"attention=tokamax does not implement sinks=True"),
])
def test_invalid_choice_for_backend_is_a_clear_error(name, backend, kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention.resolve_implementation(name, backend, **kwargs)


def test_valid_explicit_choices_pass_through():
    assert attention.resolve_implementation("cudnn", "gpu", dtype=jnp.bfloat16, head_dim=128) == "cudnn"
    assert attention.resolve_implementation("flash", "gpu", dtype=jnp.float32, head_dim=12) == "flash"
    assert attention.resolve_implementation("dot_product", "tpu") == "dot_product"
    assert attention.resolve_implementation("flash", "tpu") == "flash"  # the splash kernel
    assert attention.resolve_implementation("flash", "cpu") == "flash"  # allowed, in interpret mode


def test_runtime_describes_what_was_autoselected():
    cfg = load_config([BASE_YML, *with_overrides(TINY, "attention=autoselected", "dtype=autoselected",
                                                 "remat_policy=autoselected")])
    text = Runtime.from_config(cfg, "cpu").describe()
    assert "attention dot_product (autoselected for cpu)" in text
    assert "dtype float32 (autoselected for cpu)" in text
    # A small dense model on CPU: nothing recomputed, layers unrolled (measured faster, docs/performance.md).
    assert "remat none (autoselected for cpu)  layers unrolled (autoselected for cpu)" in text
    assert "remat full (autoselected for tpu)" in Runtime.from_config(cfg, "tpu").describe()
    assert Runtime.from_config(cfg, "gpu").dtype == jnp.bfloat16
    text = Runtime.from_config(cfg.replace(remat_policy="none", dtype="bfloat16"), "cpu").describe()
    assert "remat none" in text and "remat none (" not in text  # chosen by the user: no tag
    assert "unrolled" not in text
    assert "dtype bfloat16  " in text
    cfg = load_config([BASE_YML, *TINY, "attention=flash"])
    assert "flash (Pallas interpret mode: slow" in Runtime.from_config(cfg, "cpu").describe()
    # The config error surfaces at start-up, before anything is built.
    with pytest.raises(ValueError, match="attention=cudnn needs an NVIDIA GPU"):
        Runtime.from_config(load_config([BASE_YML, *TINY, "attention=cudnn"]), "cpu")


def test_flash_on_cpu_runs_the_kernel_in_interpret_mode_and_matches_dot_product():
    """The model's dispatch really reaches the Pallas kernel (interpreted) and gives the same loss."""
    overrides = with_overrides(TINY, "base_num_decoder_layers=1", "max_target_length=16")
    cfg = load_config([BASE_YML, *overrides, "attention=flash", "sa_block_q=16", "sa_block_kv=16"])
    params = Model.bind(cfg).init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    segments = jnp.asarray([[1] * 10 + [2] * 6, [1] * 16], jnp.int32)  # a packed row and a plain one
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
             "positions": jnp.asarray([list(range(10)) + list(range(6)), list(range(16))], jnp.int32),
             "loss_weights": jnp.ones((2, 16), jnp.float32)}
    losses = {}
    for name in ("flash", "dot_product"):
        rt = Runtime.from_config(cfg.replace(attention=name), "cpu")
        losses[name] = jax.jit(lambda p, rt=rt: Model.bind(cfg).loss_fn(p, batch, rt)[0])(params)
    np.testing.assert_allclose(losses["flash"], losses["dot_product"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_with_flash_matches_dot_product(family):
    """Sliding-window layers, attention soft-caps (gemma2) and query_pre_attn_scalar go through the
    flash kernel (interpreted): same loss and gradients as dot_product (float32, 1e-5 / 1e-4 relative)."""
    overrides = [*TINY, f"decoder_block={family}", "sliding_window_size=8", "query_pre_attn_scalar=24",
                 "logits_via_embedding=true", "sa_block_q=16", "sa_block_kv=16"]
    if family == "gemma2":
        overrides += ["attn_logits_soft_cap=20.0", "final_logits_soft_cap=30.0"]
    cfg = load_config([BASE_YML, *overrides, "attention=flash"])
    params = Model.bind(cfg).init_params(jax.random.key(1))
    rng = np.random.default_rng(1)
    length = cfg.max_target_length
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, length + 1)), jnp.int32)
    seg = np.ones((2, length), np.int32)
    seg[0, 20:] = 2
    positions = np.where(seg == 1, np.arange(length), np.arange(length) - 20)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.asarray(seg),
             "positions": jnp.asarray(positions, jnp.int32), "loss_weights": jnp.ones((2, length), jnp.float32)}
    results = {}
    for name in ("flash", "dot_product"):
        rt = Runtime.from_config(cfg.replace(attention=name), "cpu")
        results[name] = jax.jit(jax.value_and_grad(lambda p, rt=rt: Model.bind(cfg).loss_fn(p, batch, rt)[0]))(params)
    np.testing.assert_allclose(results["flash"][0], results["dot_product"][0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(results["flash"][1]), jax.tree.leaves(results["dot_product"][1])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

"""`attention: autoselected | dot_product | flash | cudnn`: what may run where, and what the user is told."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import attention, models
from maxtrain.config import load_config


@pytest.mark.parametrize("backend, expected", [("cpu", "dot_product"), ("gpu", "flash"), ("tpu", "dot_product")])
def test_autoselected_picks_per_backend(backend, expected):
    assert attention.resolve_implementation("autoselected", backend) == expected


@pytest.mark.parametrize("name, backend, kwargs, message", [
    ("cudnn", "cpu", {}, r"attention=cudnn needs an NVIDIA GPU, but JAX's backend is 'cpu'.*attention=dot_product"),
    ("cudnn", "tpu", {}, r"needs an NVIDIA GPU"),
    ("flash", "tpu", {}, r"attention=flash needs an NVIDIA GPU .* or the CPU .*backend is 'tpu'"),
    ("cudnn", "gpu", {"dtype": jnp.float32}, r"attention=cudnn needs dtype=bfloat16 or float16.*float32"),
    ("cudnn", "gpu", {"dtype": jnp.bfloat16, "head_dim": 12}, r"multiple of 8 .*head_dim=12"),
    ("cudnn", "gpu", {"dtype": jnp.bfloat16, "head_dim": 512}, r"at most 256"),
    ("splash", "cpu", {}, r"attention='splash' is not one of autoselected, dot_product, flash, cudnn"),
])
def test_invalid_choice_for_backend_is_a_clear_error(name, backend, kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention.resolve_implementation(name, backend, **kwargs)


def test_valid_explicit_choices_pass_through():
    assert attention.resolve_implementation("cudnn", "gpu", dtype=jnp.bfloat16, head_dim=128) == "cudnn"
    assert attention.resolve_implementation("flash", "gpu", dtype=jnp.float32, head_dim=12) == "flash"
    assert attention.resolve_implementation("dot_product", "tpu") == "dot_product"
    assert attention.resolve_implementation("flash", "cpu") == "flash"  # allowed, in interpret mode


def test_runtime_describes_what_was_autoselected():
    cfg = load_config([BASE_YML, *TINY, "attention=autoselected", "dtype=autoselected", "remat_policy=autoselected"])
    text = models.Runtime.from_config(cfg, "cpu").describe()
    assert "attention dot_product (autoselected for cpu)" in text
    assert "dtype float32 (autoselected for cpu)" in text
    assert "remat full (autoselected for cpu)" in text  # measured fastest on CPU (docs/performance.md)
    assert models.Runtime.from_config(cfg, "gpu").dtype == jnp.bfloat16
    text = models.Runtime.from_config(cfg.replace(remat_policy="none", dtype="bfloat16"), "cpu").describe()
    assert "remat none" in text and "remat none (" not in text  # chosen by the user: no tag
    assert "dtype bfloat16  " in text
    cfg = load_config([BASE_YML, *TINY, "attention=flash"])
    assert "flash (Pallas interpret mode: slow" in models.Runtime.from_config(cfg, "cpu").describe()
    # The config error surfaces at start-up, before anything is built.
    with pytest.raises(ValueError, match="attention=cudnn needs an NVIDIA GPU"):
        models.Runtime.from_config(load_config([BASE_YML, *TINY, "attention=cudnn"]), "cpu")


def test_flash_on_cpu_runs_the_kernel_in_interpret_mode_and_matches_dot_product():
    """The model's dispatch really reaches the Pallas kernel (interpreted) and gives the same loss."""
    overrides = [*TINY, "base_num_decoder_layers=1", "max_target_length=16"]
    cfg = load_config([BASE_YML, *overrides, "attention=flash", "sa_block_q=16", "sa_block_kv=16"])
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    segments = jnp.asarray([[1] * 10 + [2] * 6, [1] * 16], jnp.int32)  # a packed row and a plain one
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
             "positions": jnp.asarray([list(range(10)) + list(range(6)), list(range(16))], jnp.int32),
             "loss_weights": jnp.ones((2, 16), jnp.float32)}
    losses = {}
    for name in ("flash", "dot_product"):
        rt = models.Runtime.from_config(cfg.replace(attention=name), "cpu")
        losses[name] = jax.jit(lambda p, rt=rt: models.loss_fn(p, batch, cfg, rt)[0])(params)
    np.testing.assert_allclose(losses["flash"], losses["dot_product"], rtol=1e-5)

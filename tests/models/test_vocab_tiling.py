"""The vocab-tiled loss (num_vocab_tiling): the same loss and gradients as the full logits, and far less memory."""

from __future__ import annotations

import jax
import jax.extend
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain.training import builder
from maxtrain.models import runtime
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import ConfigError, load_config, with_overrides


def loss_and_grads(*overrides):
    cfg = load_config([BASE_YML, *with_overrides(TINY, "vocab_size=1024", *overrides)])
    rt = Runtime.from_config(cfg)
    params = Model.bind(cfg).init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 33)).astype(np.int32)
    seg = np.ones((2, 32), np.int32)
    seg[:, 20:] = 2
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
             "positions": np.where(seg == 1, np.arange(32), np.arange(32) - 20).astype(np.int32),
             "loss_weights": (rng.random((2, 32)) > 0.2).astype(np.float32)}
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(lambda p: Model.bind(cfg).loss_fn(p, batch, rt)[0]))(params)


# float32 with full-precision matmuls: tiling changes only the order of some sums. Tolerance: the loss to
# 1e-6 relative; each gradient to 1e-5 relative or 1e-6 of its largest entry (rounding noise of the sums).
_MODELS = {"untied": [], "tied": ["logits_via_embedding=true"],
           "gemma2-softcap": ["decoder_block=gemma2", "final_logits_soft_cap=3.0", "sliding_window_size=8"]}


@pytest.mark.parametrize("model, tiles", slow_params(
    [(m, t) for t in (4, 32) for m in _MODELS.values()], {"4-untied", "4-gemma2-softcap"},
    ids=[f"{t}-{name}" for t in (4, 32) for name in _MODELS]))
def test_tiled_loss_and_gradients_equal_the_untiled_ones(model, tiles):
    loss, grads = loss_and_grads(*model, "num_vocab_tiling=1")
    tiled_loss, tiled_grads = loss_and_grads(*model, f"num_vocab_tiling={tiles}")
    assert float(tiled_loss) == pytest.approx(float(loss), rel=1e-6)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        t = jax.tree_util.tree_map(lambda x: x, tiled_grads)
        for key in path:
            t = t[key.key]
        np.testing.assert_allclose(np.asarray(t), np.asarray(g), rtol=1e-5, atol=1e-6 * float(np.abs(g).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_tiling_must_divide_the_sequence():
    with pytest.raises(ConfigError, match="num_vocab_tiling=3 must divide max_target_length=32"):
        load_config([BASE_YML, *TINY, "num_vocab_tiling=3"])


def temporaries(*overrides) -> int:
    cfg = load_config([BASE_YML, "model_name=gemma2-2b", "base_emb_dim=64", "base_mlp_dim=128", "head_dim=32",
                       "base_num_query_heads=2", "base_num_kv_heads=1", "base_num_decoder_layers=2",
                       "max_target_length=4096", "per_device_batch_size=1", "dtype=bfloat16", "attention=dot_product",
                       "ici_fsdp_parallelism=1", *overrides])
    return builder.build(cfg, devices=jax.devices()[:1]).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_a_256k_vocabulary_at_4096_tokens_needs_a_fraction_of_the_temporaries():
    """Gemma 2's 256,000-token vocabulary at sequence 4096 (its layers shrunk so that the logits dominate):
    the compiled step's temporaries with 16 tiles are at least 4x smaller than untiled (compile only)."""
    untiled, tiled = temporaries("num_vocab_tiling=1"), temporaries("num_vocab_tiling=16")
    print(f"temporaries: untiled {untiled / 2**30:.2f} GiB, 16 tiles {tiled / 2**30:.2f} GiB ({untiled / tiled:.1f}x)")
    assert untiled >= 4 * tiled


@pytest.mark.parametrize("length, logits_bytes, tiles", [
    (256, 4 * 256 * 32000 * 4, 1),        # the CPU reference configuration: 131 MB of logits, untiled
    (8192, 8192 * 128256 * 4, 8),         # Llama 3 at 8,192 tokens: 3.9 GiB in 8 chunks of 489 MiB
    (4096, 4096 * 256000 * 4, 8),         # Gemma's 256k vocabulary at 4,096 tokens
    (100, 3 * 2**29, 4),                  # 3 chunks would do, but 3 does not divide 100
    (7, 100 * 2**29, 7)])                 # more chunks needed than tokens: one token at a time
def test_autoselected_tiling_keeps_a_chunks_logits_under_512_mib(length, logits_bytes, tiles):
    assert runtime.resolve_vocab_tiles(-1, length, logits_bytes) == tiles
    assert runtime.resolve_vocab_tiles(2, length, logits_bytes) == 2  # a setting is kept


def test_autoselected_tiling_follows_the_devices_share_of_the_logits():
    """The default model is untiled; the 256k-vocabulary preset at 4096 tokens is cut into 8 chunks,
    on one device as on 8 that split the batch and the vocabulary (each holds the same share)."""
    assert builder.build(load_config([BASE_YML, "dataset_type=synthetic"]), devices=jax.devices()[:1]).rt.vocab_tiles == 1
    gemma = [BASE_YML, "model_name=gemma2-2b", "base_num_decoder_layers=1", "max_target_length=4096",
             "per_device_batch_size=1", "dataset_type=synthetic"]
    one = builder.build(load_config(gemma), devices=jax.devices()[:1]).rt
    assert one.vocab_tiles == 8 and "vocab tiles 8 (autoselected for cpu)" in one.describe()
    assert builder.build(load_config([*gemma, "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"])).rt.vocab_tiles == 8
    assert builder.build(load_config([*gemma, "num_vocab_tiling=1"]), devices=jax.devices()[:1]).rt.vocab_tiles == 1


@pytest.mark.slow
def test_the_head_gathered_once_gives_the_same_loss_and_gradients_on_a_sharded_mesh():
    """FSDP over the 8 CPU devices, the GPU path of the tiled loss (the head cast and gathered once,
    ahead of the chunk loop, its gradient accumulated sharded like the parameters) against the untiled
    loss: the same loss and gradients (float32, full-precision matmuls)."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel

    cfg = load_config([BASE_YML, *with_overrides(TINY, "vocab_size=1024", "ici_fsdp_parallelism=8")])
    run = builder.build(cfg)
    params = run.init(jax.random.key(0))["params"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (8, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((8, 32), np.int32),
             "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
             "loss_weights": (rng.random((8, 32)) > 0.2).astype(np.float32)}

    def loss_and_grads_with(rt):
        with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules), \
                jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(lambda p: Model.bind(run.config).loss_fn(p, batch, rt)[0]))(params)

    loss, grads = loss_and_grads_with(dataclasses.replace(run.rt, vocab_tiles=1))
    gpu_loss, gpu_grads = loss_and_grads_with(dataclasses.replace(run.rt, vocab_tiles=4, backend="gpu"))
    assert float(gpu_loss) == pytest.approx(float(loss), rel=1e-6)
    for (path, g), t in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(gpu_grads)):
        np.testing.assert_allclose(np.asarray(t), np.asarray(g), rtol=1e-5, atol=1e-6 * float(np.abs(g).max()),
                                   err_msg=jax.tree_util.keystr(path))

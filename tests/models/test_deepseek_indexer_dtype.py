"""The lightning indexer's precision (indexer_dtype, models/families/deepseek/indexer.py): bfloat16 and float8 scores
against float32's within a stated tolerance (and a float8 without its per-row scales outside it), the keys they choose
against float32's where the top-k drops keys, float32 bitwise the formula as it was, a tiny DeepSeek-V3.2 training
with each setting, and what is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.models import fp8
from maxtrain.models.families.deepseek import indexer, selected
from maxtrain.training import builder
from test_deepseek_indexer import batch_of, tiny  # noqa: E402  (tests/models/ is on sys.path)

# |I - I_float32| / max|I_float32| at most: bfloat16's 8-bit mantissas (measured 0.003 here), float8 e4m3's 3 bits with
# a scale per row (measured 0.046); float8 without the scales is 0.16 on the small operands below (the control).
TOLERANCE = {"bfloat16": 1e-2, "float8": 8e-2}
# The mean fraction of float32's chosen keys that each precision also chooses, 512 tokens keeping 64 (measured 0.998
# and 0.977; the least over the queries 0.98 and 0.92).
OVERLAP = {"bfloat16": 0.97, "float8": 0.9}


def operands(t: int = 256, heads: int = 8, width: int = 64, size: float = 1.0):
    a, b, c = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(a, (1, t, heads, width)) * size, jax.random.normal(c, (1, t, heads)) * heads ** -0.5,
            jax.random.normal(b, (1, t, width)) * size)


def relative_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def unscaled_float8(q, w, k):
    """The control: q and k rounded to e4m3 as they are (clipped to its range), without the per-row scales."""
    f8 = lambda a: jnp.clip(a, -448, 448).astype(fp8.E4M3).astype(jnp.float32)  # noqa: E731
    return indexer.combine(f8(q), w, f8(k))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_scores_are_float32s_within_the_tolerance(dtype):
    for size in (1.0, 0.005):  # the per-row scales make float8's error independent of the operands' size
        q, w, k = operands(size=size)
        assert relative_error(indexer.combine(q, w, k, dtype), indexer.combine(q, w, k)) < TOLERANCE[dtype]


def test_the_control_float8_without_its_scales_fails_the_tolerance():
    q, w, k = operands(size=0.005)  # e4m3's subnormals are 2^-9 apart: 0.005 keeps ~1 bit unscaled
    assert relative_error(unscaled_float8(q, w, k), indexer.combine(q, w, k)) > TOLERANCE["float8"]


def test_row_scales_map_each_rows_absmax_to_e4m3s_top_and_a_zero_row_to_one():
    a = jnp.array([[1.0, -896.0], [0.0, 0.0]])
    np.testing.assert_array_equal(indexer.row_scales(a), [[2.0], [1.0]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_the_chosen_keys_overlap_float32s_where_top_k_drops_keys(dtype):
    t, topk = 512, 64
    q, w, k = operands(t)
    seg = jnp.ones((1, t), jnp.int32)
    choose = jax.jit(lambda d: selected.chosen(q, w, k, seg, topk=topk, block=64, dtype=d), static_argnums=0)
    (i0, m0), (i1, m1) = choose("float32"), choose(dtype)
    i0, m0, i1, m1 = map(np.asarray, (i0, m0, i1, m1))
    overlap = [len(set(i0[0, s][m0[0, s]]) & set(i1[0, s][m1[0, s]])) / topk for s in range(topk, t)]
    assert np.mean(overlap) >= OVERLAP[dtype], np.mean(overlap)
    assert np.mean(overlap) < 1.0  # the precision changes some choices: the test compares two different things


def test_float32_is_bitwise_the_formula_as_it_was():
    q, w, k = operands()

    def before(q, w, k):  # indexer.combine before indexer_dtype
        per_head = jax.nn.relu(jnp.einsum("BTIE,BSE->BTIS", q, k) * q.shape[3] ** -0.5)
        return jnp.einsum("BTI,BTIS->BTS", w, per_head)

    want = jax.jit(before)(q, w, k)
    np.testing.assert_array_equal(jax.jit(indexer.combine)(q, w, k), want)
    np.testing.assert_array_equal(jax.jit(lambda *a: indexer.combine(*a, "float32"))(q, w, k), want)
    assert np.any(np.asarray(jax.jit(lambda *a: indexer.combine(*a, "bfloat16"))(q, w, k)) != want)  # control


def train(steps, *overrides):
    run = builder.build(tiny("indexer_training=sparse", "max_target_length=16", "learning_rate=0.01",
                             "warmup_steps_fraction=0", "lr_schedule_type=constant", *overrides),
                        devices=jax.devices()[:1])
    state = run.init(jax.random.key(0))
    batch = jax.tree.map(lambda a: a[None], batch_of(run.config))
    history = []
    for _ in range(steps):
        state, metrics = run.train_step(state, batch)
        history.append({k: float(metrics[k]) for k in ("loss", "aux/indexer_kl")})
    return history


# each ~15 s of compiling; float32 (the default): test_deepseek_indexer.py's sparse-stage training test
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.slow),
                                   pytest.param("float8", marks=pytest.mark.slow)])  # the default run checks the scores
def test_a_tiny_deepseek_v32_trains_at_each_precision(dtype):
    """16 tokens keeping 6 (the selected-key path), the sparse stage: the LM loss and the indexer's KL finite and
    falling, the KL's gradient reaching the indexer through its float32 scores."""
    history = train(6, f"indexer_dtype={dtype}")
    assert all(np.isfinite(v) for h in history for v in h.values()), history
    assert history[-1]["loss"] < history[0]["loss"], history
    assert history[-1]["aux/indexer_kl"] < history[0]["aux/indexer_kl"], history


def test_refused_in_one_line_without_an_indexer():
    with pytest.raises(ConfigError, match=r"indexer_dtype='float8' does nothing without a lightning indexer "
                                          r"\(index_n_heads > 0\).*or drop indexer_dtype"):
        load_config(with_overrides([BASE_YML], "model_name=deepseek3-tiny", "indexer_dtype=float8"))


def test_the_fused_scores_kernel_refuses_a_precision_it_does_not_have():
    q, w, k = operands(64)
    with pytest.raises(ValueError, match=r"scores in float32 alone, not indexer_dtype=float8; set indexer_dtype"):
        selected.chosen(q, w, k, jnp.ones((1, 64), jnp.int32), topk=8, block=64, fused=True, dtype="float8")

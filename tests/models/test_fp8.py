"""quantization=fp8 (models/fp8.py) on CPU, where XLA emulates float8: the matmul and its gradients against
a plain numpy float8 reference (ml_dtypes' e4m3fn and e5m2, quantized and dequantized with the same
scales), tensors that could make a scale 0 or inf, and the model with its matmuls in float8.
tests/compile/test_fp8_compile.py checks that the H100 compiler makes them float8 cuBLASLt matmuls."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.models.runtime import Runtime
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.models import blocks, fp8, ops
from maxtrain.training import builder

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def reference_round(a, largest, fp8_dtype):
    """numpy: a rounded to fp8_dtype at the scale amax|a| / largest (float32 compute dtype)."""
    amax = np.float32(np.abs(a).max())
    s = np.float32(amax / np.float32(largest)) if amax > 0 else np.float32(1.0)
    return np.clip(a / s, -largest, largest).astype(fp8_dtype).astype(np.float32) * s


def test_matmul_and_its_gradients_match_a_numpy_float8_reference():
    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal(shape).astype(np.float32) * scale
               for shape, scale in (((2, 8, 48), 3.0), ((48, 40), 0.05), ((2, 8, 40), 1e-3)))
    y, vjp = jax.vjp(lambda a, b: ops.dense(a, b, fp8=True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))

    xq, wq, gq = reference_round(x, 448.0, E4M3), reference_round(w, 448.0, E4M3), reference_round(g, 57344.0, E5M2)
    np.testing.assert_allclose(np.asarray(y), xq @ wq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), gq @ wq.T, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("btk,btn->kn", xq, gq), rtol=1e-5, atol=1e-9)
    # float8 does round: the result is not the float32 product
    assert np.abs(np.asarray(y) - x @ w).max() > 1e-3
    # the rounding is what e4m3 allows: 3 mantissa bits, a relative step of at most 2**-3 per operand
    assert np.abs(xq - x).max() <= 2**-4 * np.abs(x).max()


@pytest.mark.parametrize("dimension_numbers, x_shape, w_shape", [
    ((((1,), (0,)), ((), ())), (16, 48), (48, 40)), ((((2,), (1,)), ((0,), (0,))), (3, 8, 16), (3, 16, 8)),
    ((((0,), (1,)), ((), ())), (24, 7), (9, 24))])
def test_the_tpu_form_matches_the_numpy_float8_reference(dimension_numbers, x_shape, w_shape):
    """The TPU form (float8 x float8 matmul, scales applied to its float32 result) evaluated on CPU, forward
    and both gradients, against the same reference as the form above, the gradients' transposes included."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(x_shape).astype(np.float32) * 3.0, rng.standard_normal(w_shape).astype(np.float32) * 0.05
    fn = lambda a, b: fp8.fp8_dot_general(a, b, dimension_numbers, platform="tpu")  # noqa: E731
    y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
    g = rng.standard_normal(y.shape).astype(np.float32) * 1e-3
    dx, dw = vjp(jnp.asarray(g))
    xq, wq, gq = reference_round(x, 448.0, E4M3), reference_round(w, 448.0, E4M3), reference_round(g, 57344.0, E5M2)
    _, reference_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), xq, wq)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.lax.dot_general(xq, wq, dimension_numbers)),
                               rtol=1e-5, atol=1e-6)
    for got, expected in zip((dx, dw), reference_vjp(gq)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-9)


def test_the_tpu_form_keeps_the_float8_operands_in_its_matmuls():
    """Forward and both gradients: dot_generals of float8 arrays (e5m2 against e4m3 backward), in float32."""
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)
    text = jax.jit(jax.value_and_grad(lambda a, b: fp8.fp8_dot_general(a, b, (((1,), (0,)), ((), ())), jnp.float32, "tpu").sum(),
                            argnums=(0, 1))).lower(x, w).as_text()
    products = [line for line in text.splitlines() if "dot_general" in line]
    assert len(products) == 3 and all("f8E4M3FN" in line and "-> tensor<" in line for line in products), products
    assert sum("f8E5M2" in line for line in products) == 2, products


def test_scale_round_trip_uses_one_value_in_the_compute_dtype():
    a = jnp.asarray(np.random.default_rng(1).standard_normal((64,)) * 7.0, jnp.bfloat16)
    s = fp8.scale(a, fp8.E4M3, jnp.bfloat16)
    assert s == s.astype(jnp.bfloat16).astype(jnp.float32)  # representable in the compute dtype
    q = fp8.quantize(a, s, fp8.E4M3)
    assert q.dtype == jnp.float8_e4m3fn and float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= 448.0
    expected = (np.asarray(a, np.float32) / np.float32(s)).clip(-448, 448).astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q, np.float32), expected)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", ["zeros", "huge", "huge_gradient", "tiny"])
def test_zero_huge_and_tiny_tensors_stay_finite(dtype, case):
    """Each product's exact value is finite (|x| 1e30 meets a 1e-3 gradient, a 1e30 gradient |x| ~ 1)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((32, 8)).astype(np.float32) * 1e-3
    x = {"zeros": np.zeros_like(x), "huge": x * 1e30, "huge_gradient": x, "tiny": x * 1e-30}[case]
    g = np.ones((16, 8), np.float32) * {"zeros": 0.0, "huge": 1e-3, "huge_gradient": 1e30, "tiny": 1e-30}[case]
    y, vjp = jax.vjp(lambda a, b: ops.dense(a, b, fp8=True), jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    dx, dw = vjp(jnp.asarray(g, dtype))
    for a in (y, dx, dw):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), case
    if case == "zeros":
        assert not np.any(np.asarray(y, np.float32)) and not np.any(np.asarray(dw, np.float32))
    if case == "huge":  # the product keeps its size: no overflow, no flush to zero
        np.testing.assert_allclose(np.asarray(y, np.float32), x @ w, rtol=0.2, atol=0.05 * np.abs(x @ w).max())


def test_batched_expert_matmul_matches_the_einsum_up_to_float8_rounding():
    rng = np.random.default_rng(3)
    xe, we = rng.standard_normal((3, 5, 16)).astype(np.float32), rng.standard_normal((3, 16, 8)).astype(np.float32)
    y = fp8.fp8_dot_general(jnp.asarray(xe), jnp.asarray(we), (((2,), (1,)), ((0,), (0,))))
    np.testing.assert_allclose(np.asarray(y), np.einsum("ecd,edf->ecf", reference_round(xe, 448.0, E4M3),
                                                        reference_round(we, 448.0, E4M3)), rtol=1e-5, atol=1e-5)


def config_with(*overrides):
    return load_config(with_overrides([BASE_YML, *TINY], "dtype=bfloat16", *overrides))


def test_runtime_places_float8_where_the_key_names():
    assert Runtime.from_config(config_with(), "cpu").fp8 == frozenset()
    assert Runtime.from_config(config_with("quantization=fp8"), "cpu").fp8 == {"attention", "mlp"}
    rt = Runtime.from_config(config_with("quantization=fp8_mlp", "quantize_output_head=true"), "gpu")
    assert rt.fp8 == {"mlp", "head"} and "float8 matmuls: head, mlp" in rt.describe()
    moe = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"]
    assert Runtime.from_config(config_with("quantization=fp8", *moe, "moe_dispatch=capacity"), "cpu").fp8 == {
        "attention", "mlp", "experts"}
    assert Runtime.from_config(config_with("quantization=fp8", *moe), "cpu").fp8 == {"attention", "mlp"}  # dropless


def test_the_mlp_block_runs_in_float8_where_the_runtime_says():
    """Eagerly (no compile): blocks.mlp with the runtime's "mlp" place on and off; the whole model's
    matmuls are checked on the H100 compile (tests/compile/test_fp8_compile.py) and over 300 CPU steps
    (end_to_end/cpu/fp8_loss.py)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 4, 32)), jnp.float32)
    p = {name: jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)
         for name, shape in (("w_gate", (32, 64)), ("w_up", (32, 64)), ("w_down", (64, 32)))}
    rt = Runtime.from_config(load_config([BASE_YML, *TINY]), "cpu")  # float32
    plain, quantized = (blocks.mlp(x, p, dataclasses.replace(rt, fp8=places)) for places in (frozenset(), {"mlp"}))
    gate = ops.dense(x, p["w_gate"], fp8=True)
    up = ops.dense(x, p["w_up"], fp8=True)
    expected = ops.dense(jax.nn.silu(gate) * up, p["w_down"], fp8=True)
    np.testing.assert_array_equal(np.asarray(quantized), np.asarray(expected))
    assert 0 < float(jnp.max(jnp.abs(quantized - plain))) < 0.1 * float(jnp.max(jnp.abs(plain)))


@pytest.mark.parametrize("backend, kind, capability, refused", [
    ("gpu", "NVIDIA A100-SXM4-80GB", "8.0", True), ("gpu", "NVIDIA H100 80GB HBM3", "9.0", False),
    ("gpu", "NVIDIA L4", "8.9", False), ("tpu", "TPU v5 lite", None, True), ("tpu", "TPU v6 lite", None, True),
    ("tpu", "TPU v4", None, True), ("tpu", "TPU v5", None, True), ("tpu", "TPU7x", None, False),
    ("cpu", "cpu", None, False)])
def test_devices_without_float8_matmuls_are_refused_before_compiling(backend, kind, capability, refused):
    config = config_with("quantization=fp8")
    rt = dataclasses.replace(Runtime.from_config(config, "cpu"), backend=backend)
    device = SimpleNamespace(device_kind=kind, compute_capability=capability)
    builder.check_float8_devices(config_with(), Runtime.from_config(config_with(), "cpu"), device)  # off: fine
    if refused:
        with pytest.raises(ConfigError, match=f"quantization=fp8 cannot run on {kind}: .*leave quantization empty"):
            builder.check_float8_devices(config, rt, device)
    else:
        builder.check_float8_devices(config, rt, device)

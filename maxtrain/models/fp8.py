"""float8 matmuls (`quantization=fp8`): the forward product of e4m3 operands, its gradients from an e5m2
gradient, with current (just-in-time) scaling per tensor.

    s_x = amax|x| / 448,  q(x) = e4m3(clip(x / s_x))         the activations and, alike, the weights
    y   = (q(x) s_x) . (q(w) s_w)
    s_g = amax|g| / 57344,  q(g) = e5m2(clip(g / s_g))       the incoming gradient
    dx, dw = the matmuls of autodiff of y, on q(g) s_g and the saved q(x) s_x, q(w) s_w

448 and 57344 are the largest finite e4m3fn and e5m2 values: the largest magnitude of each tensor maps
to the top of its format. A scale is computed in float32, then rounded to the compute dtype, and that
one value both divides (quantize) and multiplies (dequantize), so q(x) s_x is x rounded to e4m3 at the
tensor's scale and nothing else. An all-zero tensor gets scale 1 (never a division by zero); a tensor
whose amax is huge or tiny stays finite, its values clipped to the format's range before the cast.

Only the quantized operands are kept for the backward pass: one byte per element instead of two.

How a compiler sees it: each matmul is dot(convert(x_f8) * s_x, convert(w_f8) * s_w), the pattern
XLA's GPU gemm rewriter turns into one cuBLASLt float8 matmul (`__cublas$lt$matmul$f8`, the scales
passed to cuBLASLt) on compute capability 8.9 and newer; cuBLASLt takes at most one e5m2 operand, so
each gradient matmul pairs the e5m2 gradient with an e4m3 operand. Elsewhere (XLA:CPU) the same
program computes the rounding exactly, in the compute dtype (float8 emulated).

On TPU (platform="tpu") libtpu turns that pattern into a bfloat16 matmul, so there each matmul is the
product of the float8 arrays themselves, accumulated in float32, with the two scales applied to it:
y = (q(x) . q(w)) s_x s_w, and alike dx = (q(g) . q(w)^T) s_g s_w and dw = (q(x)^T . q(g)) s_x s_g, the
e5m2 gradient against e4m3 operands. libtpu keeps those operands float8 (docs/scale.md, "float8
matmuls", says on which chips). The same values as the form above, up to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
LARGEST = {E4M3: 448.0, E5M2: 57344.0}


def scale(a, fp8_dtype, dtype):
    """amax|a| / LARGEST[fp8_dtype] in float32, rounded to `dtype` (the dequantized operands' dtype);
    1 where that is 0 or not finite (an all-zero tensor, or an amax that underflows in `dtype`)."""
    amax = jnp.max(jnp.abs(a)).astype(jnp.float32)
    s = (amax / LARGEST[fp8_dtype]).astype(dtype).astype(jnp.float32)
    return jnp.where((s > 0) & jnp.isfinite(s), s, jnp.float32(1.0))


def quantize(a, s, fp8_dtype):
    """a / s clipped to the format's range and rounded to fp8_dtype (round to nearest even)."""
    top = LARGEST[fp8_dtype]
    return jnp.clip(a.astype(jnp.float32) / s, -top, top).astype(fp8_dtype)


def dequantize(q, s, dtype):
    """q s in `dtype`: the operand of a matmul that XLA's GPU compiler runs on float8 inputs."""
    return q.astype(dtype) * s.astype(dtype)


def fp8_dot_general(x, w, dimension_numbers, out_dtype=None, platform: str | None = None):
    """jax.lax.dot_general(x, w, dimension_numbers) with e4m3 operands and e5m2 gradients (module
    docstring), accumulated in float32 and written in out_dtype (default x.dtype); the gradients come
    back in x's and w's dtypes. platform: where the step is compiled for; "tpu" takes the TPU form."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if platform == "tpu":
        return _fp8_dot_scaled(x, w, dimension_numbers, out_dtype)
    return _fp8_dot(x, w, dimension_numbers, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot(x, w, dimension_numbers, out_dtype):
    return _fp8_dot_fwd(x, w, dimension_numbers, out_dtype)[0]


def _quantized_operands(x, w):
    """(q_x, s_x, q_w, s_w): both operands in e4m3 with their per-tensor scales (both forms' forward)."""
    s_x, s_w = scale(x, E4M3, x.dtype), scale(w, E4M3, w.dtype)
    return quantize(x, s_x, E4M3), s_x, quantize(w, s_w, E4M3), s_w


def _fp8_dot_fwd(x, w, dimension_numbers, out_dtype):
    q_x, s_x, q_w, s_w = _quantized_operands(x, w)
    y = jax.lax.dot_general(dequantize(q_x, s_x, x.dtype), dequantize(q_w, s_w, w.dtype), dimension_numbers,
                            preferred_element_type=out_dtype)
    return y, (q_x, s_x, q_w, s_w, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _fp8_dot_bwd(dimension_numbers, out_dtype, residuals, g):
    q_x, s_x, q_w, s_w, x_like, w_like = residuals
    dtype = x_like.dtype  # the compute dtype: the dequantized gradient and both products are in it
    s_g = scale(g, E5M2, dtype)
    g_dq = dequantize(quantize(g, s_g, E5M2), s_g, dtype)

    def product(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=dtype)

    _, vjp = jax.vjp(product, dequantize(q_x, s_x, dtype), dequantize(q_w, s_w, w_like.dtype).astype(dtype))
    dx, dw = vjp(g_dq)
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def scaled_product(a, b, dimension_numbers, s_a, s_b, dtype):
    """(a . b) s_a s_b in dtype: the float8 arrays' matmul accumulated in float32, then scaled (the
    scales one after the other, so that their product cannot underflow or overflow float32)."""
    acc = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)
    return (acc * s_a * s_b).astype(dtype)


def transposed_products(g, a, b, dimension_numbers):
    """For y = dot_general(a, b, dimension_numbers) and an incoming gradient g: the operands and
    dimension numbers of da = dot_general(g, b, ...) and db = dot_general(g, a, ...), and the axis
    permutations that put da in a's layout and db in b's (as autodiff of dot_general does)."""
    (a_con, b_con), (a_bat, b_bat) = dimension_numbers
    a_free = [i for i in range(a.ndim) if i not in a_con and i not in a_bat]
    b_free = [i for i in range(b.ndim) if i not in b_con and i not in b_bat]
    batch = list(range(len(a_bat)))  # g's axes: batch, a's free axes, b's free axes
    g_a = list(range(len(batch), len(batch) + len(a_free)))
    g_b = list(range(len(batch) + len(a_free), g.ndim))
    # da's axes: batch, a's free, then b's contracting axes in b's order (each paired with one of a's)
    da_axes = list(a_bat) + a_free + [a_con[k] for k in sorted(range(len(b_con)), key=lambda k: b_con[k])]
    db_axes = list(b_bat) + b_free + [b_con[k] for k in sorted(range(len(a_con)), key=lambda k: a_con[k])]
    da_dims = ((g_b, b_free), (batch, list(b_bat)))
    db_dims = ((g_a, a_free), (batch, list(a_bat)))
    return da_dims, _inverse(da_axes), db_dims, _inverse(db_axes)


def _inverse(axes):
    return tuple(sorted(range(len(axes)), key=lambda i: axes[i]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot_scaled(x, w, dimension_numbers, out_dtype):
    return _fp8_dot_scaled_fwd(x, w, dimension_numbers, out_dtype)[0]


def _fp8_dot_scaled_fwd(x, w, dimension_numbers, out_dtype):
    q_x, s_x, q_w, s_w = _quantized_operands(x, w)
    y = scaled_product(q_x, q_w, dimension_numbers, s_x, s_w, out_dtype)
    return y, (q_x, s_x, q_w, s_w, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _fp8_dot_scaled_bwd(dimension_numbers, out_dtype, residuals, g):
    q_x, s_x, q_w, s_w, x_like, w_like = residuals
    s_g = scale(g, E5M2, x_like.dtype)
    q_g = quantize(g, s_g, E5M2)
    dx_dims, dx_axes, dw_dims, dw_axes = transposed_products(g, q_x, q_w, dimension_numbers)
    dx = scaled_product(q_g, q_w, dx_dims, s_g, s_w, x_like.dtype).transpose(dx_axes)
    dw = scaled_product(q_g, q_x, dw_dims, s_g, s_x, w_like.dtype).transpose(dw_axes)
    return dx, dw


_fp8_dot_scaled.defvjp(_fp8_dot_scaled_fwd, _fp8_dot_scaled_bwd)


def compiler_options(platform: str) -> dict:
    """XLA options for a step with float8 matmuls on `platform`. GPU: no Triton matmul fusions. XLA's GPU
    compiler first offers each matmul to Triton, which takes the float8 pattern as a 16-bit matmul of the
    dequantized operands (the float8 rounding then simplified away as excess precision); only a compile
    that autotunes on the GPU itself may still pick cuBLASLt's float8 matmul. Without Triton every matmul
    goes to the gemm rewriter, which makes each float8 one a cuBLASLt float8 call (`__cublas$lt$matmul$f8`),
    with or without a GPU at hand (tests/compile/test_fp8_compile.py)."""
    return {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "dot-merger"} if platform == "gpu" else {}

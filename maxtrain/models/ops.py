"""Building blocks written for speed or memory: a projection, the cross-entropy loss, the slices of a
stacked array, and the cross-entropy of a vocabulary projection computed a chunk of the sequence at a time.

Each computes exactly what the plain jnp expression computes; only the shape of the work differs,
chosen by profiling the train step on CPU (docs/performance.md, "CPU speed"):

`dense(x, w, n)`: a projection such as "BTD,DNH->BTNH" (the last n axes of x contract with the
first n axes of w), done as one 2-D matmul [M, K] . [K, N]. With the einsum, autodiff's weight
gradient "BTD,BTNH->DNH" contracts two major axes of both operands, and XLA:CPU answered with an
explicit transpose of the activation gradient fused into the elementwise and dynamic-slice ops
around it: an untiled loop that took longer than the matmuls themselves (112 ms for a 4 MiB
array in the reference CPU config). On 2-D operands the weight gradient is a single
"transposed-lhs" matmul x^T . g. Other backends are indifferent. On CPU (backend="cpu", float32)
x^T is made an array of its own before that matmul (`_product`): XLA:CPU hands a plain
[K, M] . [M, N] to its matmul library (YNNPACK) but computes one with a transposed operand in slower
code of its own or Eigen's (149 against 187 GFLOP/s for the MLP's [256, 1024] weight gradient, 91
against 150 for attention's [256, 256]; Eigen also packs the whole [1024, 32000] gradient of the
output layer into a 99 MB buffer every step); transposing x first costs a copy of x.

`cross_entropy(logits, targets, weights)`: sum of weight x (logsumexp(logits) - logits[target]),
in float32, with a hand-written backward pass (`jax.custom_vjp`). Autodiff of `take_along_axis`
scatters into a zero [B, T, V] array and keeps several [B, T, V] intermediates; the gradient is
(softmax - onehot(target)) x weight, computed here in one elementwise pass from the saved logits
and log-normalizer. Over a 32k vocabulary this halved the loss's share of the CPU step.

`unstack(a)`: the L slices a[0], ..., a[L - 1] of a stacked array, whose gradient is one stack of the
L slice gradients. Autodiff of a[i] pads each slice's gradient to the whole [L, ...] shape with zeros
and adds the L padded arrays; XLA:CPU kept them apart, wrote the four 4 MiB pads of each stacked MLP
weight and read all of them in each of the optimizer's fusions (unrolled layers of the reference CPU
config: 7% of the step's non-matmul time).

`tiled_cross_entropy(logits_fn, head, x, targets, weights, tiles)`: the same loss for the logits
`logits_fn(head, x)`, but the sequence is cut into `tiles` chunks and only one chunk's [B, T/tiles, V]
float32 logits (and their gradient) exist at a time (MaxText's num_vocab_tiling): for a 256k
vocabulary at 8k tokens the full logits alone are 8 GiB per sequence. Under differentiation its
forward pass computes each chunk's loss and gradients together and accumulates the head's gradient
over the chunks (float16, whose unscaled gradients could underflow, recomputes each chunk's logits
in the backward pass instead).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from maxtrain.models.fp8 import fp8_dot_general
from maxtrain.parallel import sharding


def dense(x, w, n: int = 1, out_dtype=None, backend: str | None = None, fp8: bool = False):
    """x [..., K1..Kn] . w [K1..Kn, ...] -> [..., w's remaining axes], in out_dtype (default x.dtype).
    backend: the platform the step is compiled for; "cpu" computes a float32 weight gradient from an
    explicitly transposed x (module docstring). fp8: the matmul and its two gradient matmuls take
    float8 operands (`fp8_dot_general`, quantization=fp8; "tpu" takes its TPU form).

    Computed as one 2-D matmul [M, K] . [K, N] (M = the product of x's leading axes). Products
    accumulate in float32 (TPUs and GPUs do so for 16-bit operands; XLA:CPU computes them in
    float32) and are written in out_dtype: a 16-bit product is written in 16 bits directly, and so
    are its gradients, rather than written in float32 and converted (a float32 array twice the
    size, which XLA does not always fuse away: the largest were the MLP's and the output layer's
    weight gradients). A float32 product of 16-bit operands (the output logits) is exact forward,
    and its gradients are computed as those of any other matmul of the run, from the incoming
    gradient rounded to the operands' dtype (`_product`): otherwise the output projection's
    weight gradient would be a float32 [D, V] array on every device before its reduce-scatter
    (2 GiB for Llama 3's 128k vocabulary).
    """
    k = math.prod(w.shape[:n])
    w2 = w.reshape(k, -1)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if sharding.ways("length") > 1 and not fp8:
        # The sequence is split over the context axes: merging it with the batch axis into M would make GSPMD
        # gather every token of the activation onto every device (a merged axis it cannot split as both were),
        # so the leading axes stay apart: x [..., K] . w [K, N], its weight gradient contracting them all.
        x2 = x.reshape(x.shape[:x.ndim - n] + (k,))
    else:
        x2 = x.reshape(-1, k)
    if fp8:
        out = fp8_dot_general(*_vary_alike(x2, w2), dimension_numbers=(((1,), (0,)), ((), ())), out_dtype=out_dtype,
                              platform=backend)
    elif x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16):
        out = _product(*_vary_alike(x2, w2), False) if out_dtype == jnp.float32 else jnp.dot(x2, w2).astype(out_dtype)
    elif backend == "cpu" and x.dtype == w.dtype == out_dtype == jnp.float32:
        out = _product(*_vary_alike(x2, w2), True)
    else:
        out = jnp.dot(x2, w2, preferred_element_type=jnp.float32).astype(out_dtype)
    return out.reshape(x.shape[:x.ndim - n] + w.shape[n:])


def _vary_alike(x, w):
    """x and w made to vary over the same manual mesh axes (inside shard_map; unchanged outside).

    A custom rule's gradient for an operand replicated over an axis the other varies over (the MoE
    router's weight against a shard's tokens) would vary over that axis; cast first, JAX's transpose of
    the cast sums that gradient over the axis, as autodiff of a plain matmul does."""
    vx, vw = _varying(x), _varying(w)
    if vw - vx:
        x = jax.lax.pcast(x, tuple(sorted(vw - vx)), to="varying")
    if vx - vw:
        w = jax.lax.pcast(w, tuple(sorted(vx - vw)), to="varying")
    return x, w


def _varying(a) -> frozenset:
    """The manual mesh axes `a` varies over (jax 0.10: aval.manual_axis_type.varying; older: aval.vma)."""
    aval = jax.typeof(a)
    axis_type = getattr(aval, "manual_axis_type", None)
    return axis_type.varying if axis_type is not None else frozenset(getattr(aval, "vma", ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(x, w, own_transpose: bool):
    """x . w in float32 (x and w 16-bit or float32), its gradients in x's dtype; with own_transpose the
    weight gradient is a plain matmul of an x^T of its own (CPU, module docstring)."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _product_fwd(x, w, own_transpose):
    return _product(x, w, own_transpose), (x, w)


def _product_bwd(own_transpose, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    if x.ndim > 2:  # leading axes kept apart (dense under context parallelism)
        leading = tuple(range(x.ndim - 1))
        return jnp.dot(g, w.T), jnp.tensordot(x, g, axes=(leading, leading))
    # The barrier keeps XLA from folding the transpose back into the matmul as a transposed operand.
    x_t = jax.lax.optimization_barrier(x.T) if own_transpose else x.T
    return jnp.dot(g, w.T), jnp.dot(x_t, g)


_product.defvjp(_product_fwd, _product_bwd)


@jax.custom_vjp
def unstack(a) -> tuple:
    """(a[0], ..., a[L - 1]) of a stacked array a [L, ...]; the gradient is the slices' gradients stacked."""
    return tuple(a[i] for i in range(a.shape[0]))


def _unstack_fwd(a):
    return unstack(a), None


def _unstack_bwd(_, gs):
    return (jnp.stack(gs),)


unstack.defvjp(_unstack_fwd, _unstack_bwd)


@jax.custom_vjp
def cross_entropy(logits, targets, weights):
    """sum over tokens of weights x (logsumexp(logits) - logits[target]); logits [..., V] float32."""
    return _cross_entropy_fwd(logits, targets, weights)[0]


def _log_normalizer(logits):
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    return peak[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1))


def _cross_entropy_fwd(logits, targets, weights):
    if logits.dtype != jnp.float32:
        raise TypeError(f"cross_entropy takes float32 logits, got {logits.dtype}")
    log_z = _log_normalizer(logits)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # a gather, no scatter
    weights = weights.astype(jnp.float32)
    return jnp.sum((log_z - target_logit) * weights), (logits, log_z, targets, weights)


def _cross_entropy_bwd(residuals, g):
    logits, log_z, targets, weights = residuals
    is_target = targets[..., None] == jnp.arange(logits.shape[-1], dtype=targets.dtype)
    probs = jnp.exp(logits - log_z[..., None])
    dlogits = (probs - is_target.astype(jnp.float32)) * (g * weights)[..., None]
    return dlogits, None, None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def tiled_cross_entropy(logits_fn, head, x, targets, weights, tiles: int, layout=None):
    """sum over tokens of weights x (logsumexp(l) - l[target]) with l = logits_fn(head, x), one of `tiles`
    sequence chunks at a time. x [B, T, D], targets and weights [B, T]; T % tiles == 0. Differentiable in
    head (any pytree: the final norm, the output projection) and x. layout (a function of a tree shaped
    like head) constrains the float32 accumulator of head's gradient over the chunks: sharded like the
    parameters, it holds a device's share, not a whole copy of the output projection's gradient."""
    layout = layout or (lambda tree: tree)
    b, t = targets.shape
    if t % tiles:
        raise ValueError(f"sequence length {t} is not a multiple of num_vocab_tiling={tiles}")

    def chunks(a):  # [B, T, ...] -> [tiles, B, T / tiles, ...]: each chunk keeps the batch's sharding
        return jnp.moveaxis(a.reshape((b, tiles, t // tiles) + a.shape[2:]), 1, 0)

    def chunk_loss(h, xc, tc, wc):
        return cross_entropy(logits_fn(h, xc), tc, wc)

    def scan_chunks(body, init, x, targets, weights):
        return jax.lax.scan(body, init, (chunks(x), chunks(targets), chunks(weights)))

    def unchunk(dx):  # [tiles, B, T / tiles, D] -> [B, T, D]
        return jnp.moveaxis(dx, 0, 1).reshape(x.shape)

    def chunk_gradients(h, c, g):  # (loss, d/dh, d/dx) of one chunk for the incoming gradient g
        xc, tc, wc = c
        loss_c, vjp = jax.vjp(lambda hh, xx: chunk_loss(hh, xx, tc, wc), h, xc)
        return (loss_c, *vjp(g))

    def accumulate(dh, dh_c):  # a chunk's gradient is reduced into the layout in its own dtype, then added in float32
        return layout(jax.tree.map(lambda a, d: a + d.astype(jnp.float32), dh, layout(dh_c)))

    def zeros(h):
        return layout(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), h))

    @jax.custom_vjp
    def loss(h, x, targets, weights):
        return scan_chunks(lambda acc, c: (acc + chunk_loss(h, *c), None), jnp.float32(0.0), x, targets, weights)[0]

    # The gradients for an incoming gradient of 1, computed in the forward pass while each chunk's
    # logits are at hand, so that no chunk's logits are computed twice (a third fewer output-layer
    # FLOPs than recomputing them in the backward pass). The loss is the forward pass' last value
    # and its backward pass the first of the backward, so the gradients are kept no longer than
    # the backward pass keeps them. float16 (loss scaling) instead recomputes the logits in the
    # backward pass: the unscaled gradients could underflow there.
    def _forward(h, x, targets, weights):
        def body(carry, c):
            total, dh = carry
            loss_c, dh_c, dx_c = chunk_gradients(h, c, jnp.float32(1.0))
            return (total + loss_c, accumulate(dh, dh_c)), dx_c

        (total, dh), dx = scan_chunks(body, (jnp.float32(0.0), zeros(h)), x, targets, weights)
        return total, (dh, unchunk(dx))

    def _backward(residuals, g):
        dh, dx = residuals
        return jax.tree.map(lambda d, a: (d * g).astype(a.dtype), dh, head), dx * g.astype(dx.dtype), None, None

    def _forward_recompute(h, x, targets, weights):
        return loss(h, x, targets, weights), (h, x, targets, weights)

    def _backward_recompute(residuals, g):
        h, x, targets, weights = residuals

        def body(dh, c):
            _, dh_c, dx_c = chunk_gradients(h, c, g)
            return accumulate(dh, dh_c), dx_c

        dh, dx = scan_chunks(body, zeros(h), x, targets, weights)
        return jax.tree.map(lambda d, a: d.astype(a.dtype), dh, h), unchunk(dx), None, None

    if x.dtype == jnp.float16:
        loss.defvjp(_forward_recompute, _backward_recompute)
    else:
        loss.defvjp(_forward, _backward)
    return loss(head, x, targets, weights)

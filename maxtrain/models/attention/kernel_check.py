"""Attention implementations checked against the plain-jnp reference, and their FLOPs: what
scripts/gpu_report.py, scripts/benchmark_attention.py and tests/gpu_check/test_gpu.py check and time.

    Case                one shape: batch, length, heads, kv heads, head dim, dtype, causal, packed
    inputs(case, seed)  fresh random q, k, v, dO (and packed segment ids)
    implementation()    (q, k, v, segment_ids or None) -> out for flash | cudnn | tokamax | dot_product
    fwd_bwd(fn)         the jitted (q, k, v, segment_ids, dO) -> (out, dq, dk, dv)
    reference           the float32 reference at full matmul precision, under fwd_bwd
    relative_errors     ||x - ref|| / ||ref|| of out, dq, dk, dv; inf when x is not finite
    attention_flops     the matmul FLOPs of one attention call, forward or forward + backward

Letters as in attention.py: B batch, T length, N query heads, G kv heads, H head dim.

The comparison is METHOD-style: relative Frobenius error against a float32 reference whose matmuls
run at full precision (XLA's GPU default for float32 is TF32), on random normal inputs drawn fresh
per case. Tolerances (TOLERANCE): float32 2e-3 (the Triton kernel's float32 dots run on the
matrix units' TF32 mode, which lands near 3e-4), bfloat16 2e-2 (bf16 operands: 1e-3 to 1e-2). The
plain jnp attention computed in the input dtype is reported beside a kernel as the yardstick:
what the dtype alone costs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config import chips
from maxtrain.kernels.flash_attention import flash_attention
from maxtrain.kernels.flash_tiles import DEFAULT_SHARED_MEMORY
from maxtrain.models import attention

TOLERANCE = {"float32": 2e-3, "bfloat16": 2e-2}
IMPLEMENTATIONS = ("flash", "cudnn", "tokamax", "dot_product")
OUTPUTS = ("out", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention shape: q [B, T, N, H], k and v [B, T, G, H] (self-attention)."""
    batch: int
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = True
    packed: bool = True      # segment ids: three documents per row, then padding (id 0); False: none
    block_q: int = 128       # the flash kernel's largest tiles (sa_block_q, sa_block_kv)
    block_k: int = 128

    @property
    def name(self) -> str:
        """e.g. `bf16 h128 gqa4 T1000 causal packed`."""
        dtype = {"bfloat16": "bf16", "float32": "f32"}.get(self.dtype, self.dtype)
        return (f"{dtype} h{self.head_dim} gqa{self.heads // self.kv_heads} T{self.length} "
                f"{'causal' if self.causal else 'full'}{' packed' if self.packed else ''}")

    def shapes(self) -> dict:
        """(shape, dtype) of each input: q, k, v, segment_ids (None when not packed), do."""
        q = ((self.batch, self.length, self.heads, self.head_dim), jnp.dtype(self.dtype))
        kv = ((self.batch, self.length, self.kv_heads, self.head_dim), jnp.dtype(self.dtype))
        seg = ((self.batch, self.length), jnp.dtype(jnp.int32)) if self.packed else None
        return {"q": q, "k": kv, "v": kv, "segment_ids": seg, "do": q}


def packed_segment_ids(batch: int, length: int, seed: int) -> np.ndarray:
    """Three documents of random lengths per row, then trailing padding (id 0)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length - 4), size=3, replace=False))
        for doc, (start, stop) in enumerate(zip([0, *cuts[:2]], cuts)):
            ids[row, start:stop] = doc + 1
    return ids


def inputs(case: Case, seed: int) -> tuple:
    """(q, k, v, segment_ids or None, do): random normal in the case's dtype, on the default device."""
    shapes = case.shapes()
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, do = (jax.random.normal(key, *shapes[name]) for key, name in zip(keys, ("q", "k", "v", "do")))
    seg = jnp.asarray(packed_segment_ids(case.batch, case.length, seed)) if case.packed else None
    return q, k, v, seg, do


def implementation(name: str, *, causal: bool, platform: str, block_q: int = 128, block_k: int = 128,
                   interpret: bool = False, devices=None):
    """(q, k, v, segment_ids or None) -> out [B, T, N, H] for one implementation.

    flash: the Pallas kernel (Triton on `platform` gpu; interpret=True on a CPU), with tiles fitted to
    the shared memory of `devices` (default: this machine's). cudnn: jax.nn.dot_product_attention's
    cuDNN kernel (segment ids as a [B, 1, T, S] mask, as the model passes them). tokamax: its Mosaic GPU
    kernel (the optional [gpu] extra; interpret=True: tokamax's XLA reference through the same wrapper,
    on a CPU). dot_product: the
    plain jnp attention in the inputs' dtype (float32 scores and softmax), as the model runs it on
    GPU and TPU.
    """
    if name == "flash":
        shared_memory = DEFAULT_SHARED_MEMORY
        if platform == "gpu":
            shared_memory = chips.gpu_shared_memory(devices if devices is not None else jax.devices())

        def flash(q, k, v, seg):
            return flash_attention(q, k, v, seg, seg, causal=causal, block_q=block_q, block_k=block_k,
                                   shared_memory=shared_memory, interpret=interpret)
        return flash
    if name == "cudnn":
        def cudnn(q, k, v, seg):
            mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")
        return cudnn
    if name == "tokamax":
        # deferred: the optional [gpu] extra's wrapper (it imports tokamax when traced)
        from maxtrain.kernels.tokamax_attention import tokamax_attention  # pylint: disable=import-outside-toplevel

        def tokamax(q, k, v, seg):
            return tokamax_attention(q, k, v, seg, causal=causal, implementation="xla" if interpret else "mosaic")
        return tokamax
    if name == "dot_product":
        def dot_product(q, k, v, seg):
            seg = jnp.ones(q.shape[:2], jnp.int32) if seg is None else seg
            return attention.dot_product_attention(q, k, v, attention.make_attention_mask(seg, seg, causal=causal))
        return dot_product
    raise ValueError(f"unknown attention implementation {name!r}; one of {', '.join(IMPLEMENTATIONS)}")


def reference(causal: bool):
    """The float32 reference: plain jnp attention on float32 copies, every matmul at full precision."""
    plain = implementation("dot_product", causal=causal, platform="cpu")

    def ref(q, k, v, seg):
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        with jax.default_matmul_precision("highest"):
            return plain(f32(q), f32(k), f32(v), seg)
    return ref


def fwd_bwd(fn):
    """jit of (q, k, v, segment_ids, do) -> (out, dq, dk, dv): the output and its vjp of do."""
    @jax.jit
    def program(q, k, v, seg, do):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return (out, *vjp(do.astype(out.dtype)))
    return program


def relative_errors(actual, expected) -> dict:
    """{out, dq, dk, dv: ||actual - expected|| / ||expected||} in float64; inf where actual is not finite."""
    errors = {}
    for name, a, e in zip(OUTPUTS, actual, expected):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        errors[name] = float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)) if np.all(np.isfinite(a)) \
            else float("inf")
    return errors


def passes(errors: dict, dtype: str) -> bool:
    """Every error within the dtype's tolerance (NaN and inf never pass)."""
    return all(e <= TOLERANCE[dtype] for e in errors.values())


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, *, causal: bool = True,
                    backward: bool = True) -> float:
    """Matmul FLOPs: 4*B*T*S*N*H forward (q@k^T and p@v, 2*T*S*H each per head), halved if causal,
    x2.5 for forward + backward (the backward's 5 matmuls of that size to the forward's 2). The useful
    work: a kernel that recomputes (flash recomputes q@k^T) is not credited for it."""
    flops = 4 * batch * q_len * kv_len * heads * head_dim
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops

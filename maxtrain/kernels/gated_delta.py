"""The chunked gated delta rule as one Pallas kernel: GPU (Triton) and TPU (Mosaic); interpret mode on CPU.

The same per-chunk algebra as models/recurrent/gated_delta.py's `chunked` (the WY / UT form; see its docstring), fused:
per (batch, head) the state S [K, V] stays on chip while the chunks stream through, and each chunk does its
matmuls and its unit-lower-triangular solve in place. The solve uses that L (strictly lower, C x C) is
nilpotent, so (I + L)^-1 = (I - L)(I + L^2)(I + L^4) ... (I + L^(C/2)): log2(C) - 1 pairs of C x C matmuls,
no row-by-row substitution (both Triton and Mosaic are good at matmuls and poor at row indexing).

What stays outside the kernel is O(T) per head and elementwise: the within-chunk cumulative log decays, the
padding to whole chunks, and the per-token masks of packed documents (which tokens the entering state
reaches, which reach the chunk's end). So memory is O(T): no [T, T] and no [T, C] array is stored.

    GPU  grid (B, N, V / block_v); a loop over the chunks in the kernel, the state's columns in registers.
    TPU  grid (B, N, M), the chunk axis sequential ("arbitrary"), the state in a VMEM scratch.

The backward is a custom_vjp that recomputes through the jnp chunked form (models/recurrent/gated_delta.py, passed in
as `reference` since kernels/ imports nothing of models/): the kernel computes that same function, so the
gradients are exactly the reference's. Inputs are computed in float32 in the kernel, whatever their dtype.

Chunk sizes: a power of two of at least 16 (a Triton dot's smallest side; a bf16 sublane tile on TPU);
`check_chunk_size` refuses others with one line naming gdn_chunk_size. Head widths: powers of two of at
least 16 on GPU (Triton blocks), multiples of 128 or whole on TPU (whole here: the blocks span the head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MIN_CHUNK = 16
GPU_BLOCK_V = 64  # value columns per GPU program: a [128, 64] float32 state is 64 registers a thread at 4 warps
_HIGHEST = jax.lax.Precision.HIGHEST


def check_chunk_size(chunk_size: int) -> None:
    """A ValueError (one line, naming gdn_chunk_size) for a chunk size the kernel cannot take."""
    c = chunk_size
    if c < MIN_CHUNK or c & (c - 1):
        good = max(MIN_CHUNK, 1 << max(0, int(c).bit_length() - 1))
        raise ValueError(f"gdn_chunk_size={c} cannot run in the gated delta-net Pallas kernel: it needs a power of "
                         f"two >= {MIN_CHUNK} (the hardware tile); set gdn_chunk_size={good} or gdn_kernel=jnp")


def head_width_problem(platform: str, key_dim: int, value_dim: int) -> str | None:
    """Why the kernel of `platform` cannot take these head widths, or None: Triton's blocks are powers of two and
    its dots at least 16 wide; the TPU kernel's blocks span the whole head (any width)."""
    if platform != "gpu":
        return None
    bad = [f"{name}={w}" for name, w in (("gdn_key_head_dim", key_dim), ("gdn_value_head_dim", value_dim))
           if w < 16 or w & (w - 1)]
    return f"{' and '.join(bad)} must be powers of two >= 16 for the GPU kernel" if bad else None


def _matmul(a, b, ta=False, tb=False, precision=_HIGHEST):
    """a @ b in float32 (a^T or b^T where asked)."""
    dims = (((0,) if ta else (1,)), ((1,) if tb else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _chunk(s, q, k, v, cum_col, cum_row, seg_col, seg_row, beta, gamma, to_end, precision=_HIGHEST):
    """One chunk: (new state [K, V], output [C, V]) from state s and the chunk's q, k [C, K], v [C, V], cum (log
    Gamma, cumulative in the chunk) as a column [C, 1] and a row [1, C], segment ids likewise, and columns
    [C, 1]: beta, gamma (Gamma_t where the entering state reaches t, else 0) and to_end (Gamma_C / Gamma_t where
    t is of the chunk's last document, else 0)."""
    dot = functools.partial(_matmul, precision=precision)
    c = q.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    keep = (row >= col) & (seg_col == seg_row)
    decay = jnp.where(keep, jnp.exp(jnp.where(keep, cum_col - cum_row, 0.0)), 0.0)  # D; no overflow off the mask
    lmat = jnp.where(row > col, decay, 0.0) * dot(k, k, tb=True) * beta            # L (strictly lower)
    eye = jnp.where(row == col, 1.0, 0.0)
    inv, power = eye - lmat, lmat                                                    # (I + L)^-1 by doubling
    for _ in range(c.bit_length() - 2):
        power = dot(power, power)
        inv = inv + dot(inv, power)
    tv = dot(inv, beta * v)
    tk = dot(inv, (beta * gamma) * k)
    u = tv - dot(tk, s)
    o = dot(gamma * q, s) + dot(dot(q, k, tb=True) * decay, u)
    last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    end_gamma = jnp.sum(jnp.where(last, gamma, 0.0))                  # Gamma_C if S0 reaches the end
    s = end_gamma * s + dot(to_end * k, u, ta=True)
    return s, o


def _f32(*refs_or_values):
    return tuple(x.astype(jnp.float32) for x in refs_or_values)


def _tpu_kernel(q_ref, k_ref, v_ref, cc_ref, cr_ref, sc_ref, sr_ref, b_ref, g_ref, e_ref, s0_ref,
                o_ref, sout_ref, s_scr):
    m = pl.program_id(2)

    @pl.when(m == 0)
    def _():
        s_scr[...] = s0_ref[...].astype(jnp.float32)

    q, k, v = _f32(q_ref[...], k_ref[...], v_ref[...])
    s, o = _chunk(s_scr[...], q, k, v, cc_ref[...], cr_ref[...], sc_ref[...], sr_ref[...], b_ref[...], g_ref[...],
                  e_ref[...])
    s_scr[...] = s
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(m == pl.num_programs(2) - 1)
    def _():
        sout_ref[...] = s.astype(sout_ref.dtype)


def _gpu_kernel(q_ref, k_ref, v_ref, cc_ref, cr_ref, sc_ref, sr_ref, b_ref, g_ref, e_ref, s0_ref,
                o_ref, sout_ref, *, chunk: int, chunks: int, precision):
    def body(i, s):
        rows = pl.ds(i * chunk, chunk)
        q, k, v = _f32(q_ref[rows, :], k_ref[rows, :], v_ref[rows, :])
        s, o = _chunk(s, q, k, v, cc_ref[rows, :], cr_ref[:, rows], sc_ref[rows, :], sr_ref[:, rows],
                      b_ref[rows, :], g_ref[rows, :], e_ref[rows, :], precision)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return s

    s = jax.lax.fori_loop(0, chunks, body, s0_ref[...].astype(jnp.float32))
    sout_ref[...] = s.astype(sout_ref.dtype)


def _prepare(q, k, v, log_decay, beta, segment_ids, chunk, has_state):
    """The kernel's inputs, [B, N, T', ...] with T' a whole number of chunks, and T."""
    b, t, n, _ = k.shape
    pad = (-t) % chunk
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    first = seg[:, :1]
    a, beta = log_decay.astype(jnp.float32), beta.astype(jnp.float32)
    if pad:  # as chunked: padding continues the last document, no decay (a = 0) and no write (k = beta = 0)
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        a, beta = jnp.pad(a, widths[:3]), jnp.pad(beta, widths[:3])
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
    m = (t + pad) // chunk
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)                                  # [B, T, N, ...] -> [B, N, T, ...]
    cum = jnp.cumsum(a.reshape(b, m, chunk, n), axis=2)                            # log Gamma in the chunk
    segc = seg.reshape(b, m, chunk)
    prev_last = jnp.concatenate([first if has_state else jnp.full_like(first, -2), segc[:, :-1, -1]], axis=1)
    reach = (segc == prev_last[..., None])[..., None]                             # [B, M, C, 1]: S0 reaches t
    gamma = jnp.where(reach, jnp.exp(cum), 0.0)
    to_end = jnp.where((segc == segc[..., -1:])[..., None], jnp.exp(cum[:, :, -1:] - cum), 0.0)
    flat = lambda x: heads_first(x.reshape(b, m * chunk, n))                       # [B, N, T']
    cum, gamma, to_end, beta = flat(cum), flat(gamma), flat(to_end), heads_first(beta)
    seg_bn = jnp.broadcast_to(seg[:, None, :], (b, n, m * chunk))
    column, row = (lambda x: x[..., :, None]), (lambda x: x[..., None, :])
    ins = (heads_first(q), heads_first(k), heads_first(v), column(cum), row(cum), column(seg_bn), row(seg_bn),
           column(beta), column(gamma), column(to_end))
    return ins, m


def forward(q, k, v, log_decay, beta, segment_ids, initial_state, *, chunk_size: int, platform: str,
            interpret: bool = False, block_v: int | None = None):
    """(o [B, T, N, V], final state [B, N, K, V] float32) of the chunked rule in the kernel of `platform`
    (gpu or tpu; interpret=True runs it on CPU). Same arguments as models/gated_delta.chunked.

    block_v (GPU): the value columns one program keeps (its state [K, block_v] in registers); every step of the
    rule is column by column in V, so the grid splits V (B, N, V / block_v); the [C, C] work repeats per block.
    Default min(V, GPU_BLOCK_V). The TPU kernel keeps the whole state in VMEM."""
    check_chunk_size(chunk_size)
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    s0 = jnp.zeros((b, n, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    ins, m = _prepare(q, k, v, log_decay, beta, segment_ids, c, initial_state is not None)
    tp = m * c
    out_shape = (jax.ShapeDtypeStruct((b, n, tp, dv), v.dtype), jax.ShapeDtypeStruct((b, n, dk, dv), jnp.float32))
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # TPU-only module: imported when a TPU kernel is built

        tok = lambda width: pl.BlockSpec((None, None, c, width), lambda i, j, h: (i, j, h, 0))
        tok_row = pl.BlockSpec((None, None, None, 1, c), lambda i, j, h: (i, j, h, 0, 0))  # rows: whole (1, C) tiles
        ins = tuple(x.reshape(b, n, m, 1, c) if x.shape[-2] == 1 else x for x in ins)
        state = pl.BlockSpec((None, None, dk, dv), lambda i, j, h: (i, j, 0, 0))
        o, s = pl.pallas_call(
            _tpu_kernel, grid=(b, n, m), out_shape=out_shape,
            in_specs=[tok(dk), tok(dk), tok(dv), tok(1), tok_row, tok(1), tok_row, tok(1), tok(1), tok(1), state],
            out_specs=[tok(dv), state], scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="gated_delta_chunked")(*ins, s0)
    elif platform == "gpu":
        from jax.experimental.pallas import triton as plgpu  # the Triton backend's module: only for a GPU kernel

        bv = block_v or min(dv, GPU_BLOCK_V)
        if dv % bv:
            raise ValueError(f"block_v={bv} must divide the value head width {dv}")
        whole = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, j, h: (i, j) + (0,) * len(shape))
        cols = lambda rows: pl.BlockSpec((None, None, rows, bv), lambda i, j, h: (i, j, 0, h))
        # Tensor cores at about float32's accuracy (three TF32 passes); Triton's IEEE float32 dot has none
        precision = _HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        kernel = functools.partial(_gpu_kernel, chunk=c, chunks=m, precision=precision)
        in_specs = [whole(tp, dk), whole(tp, dk), cols(tp), whole(tp, 1), whole(1, tp), whole(tp, 1),
                    whole(1, tp), whole(tp, 1), whole(tp, 1), whole(tp, 1), cols(dk)]
        o, s = pl.pallas_call(kernel, grid=(b, n, dv // bv), out_shape=out_shape, in_specs=in_specs,
                              out_specs=[cols(tp), cols(dk)], interpret=interpret,
                              compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                              name="gated_delta_chunked")(*ins, s0)
    else:
        raise ValueError(f"the gated delta-net kernel runs on gpu or tpu, not {platform!r} (use gdn_kernel=jnp)")
    return jnp.swapaxes(o, 1, 2)[:, :t], s


def make(reference, *, chunk_size: int, platform: str, interpret: bool = False):
    """The rule f(q, k, v, log_decay, beta, segment_ids, initial_state) -> (o, final state) by the kernel, with a
    custom VJP whose backward differentiates `reference` (models/gated_delta.chunked, same signature, keyword
    chunk_size) at the same inputs. initial_state may be None (zeros; then no gradient for it)."""
    check_chunk_size(chunk_size)

    @jax.custom_vjp
    def rule(q, k, v, log_decay, beta, segment_ids, initial_state):
        return forward(q, k, v, log_decay, beta, segment_ids, initial_state, chunk_size=chunk_size,
                       platform=platform, interpret=interpret)

    def fwd(q, k, v, log_decay, beta, segment_ids, initial_state):
        return rule(q, k, v, log_decay, beta, segment_ids, initial_state), (q, k, v, log_decay, beta, segment_ids,
                                                                             initial_state)

    def bwd(res, cotangents):
        q, k, v, log_decay, beta, segment_ids, initial_state = res
        do, ds = cotangents

        def ref(q, k, v, log_decay, beta, initial_state):
            o, s = reference(q, k, v, log_decay, beta, segment_ids, chunk_size=chunk_size,
                             initial_state=initial_state)
            return o, s.astype(jnp.float32)

        _, pullback = jax.vjp(ref, q, k, v, log_decay, beta, initial_state)
        grads = pullback((do.astype(v.dtype), ds))
        seg_grad = None if segment_ids is None else jnp.zeros(segment_ids.shape, jax.dtypes.float0)
        return grads[:5] + (seg_grad, grads[5])

    rule.defvjp(fwd, bwd)
    return rule

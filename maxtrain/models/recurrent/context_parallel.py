"""The gated delta-net under context parallelism: its convolution and its rule on a sequence split over devices.

With context parallelism C (parallel/context.py, dual_chunk_swap) the sequence is cut into 2C contiguous chunks and
device i holds chunks i and 2C - 1 - i, T / 2C tokens each. Both parts of the layer that look along the sequence
run inside shard_map over the context mesh axes, each device on its own two chunks; everything else in the layer is
per token and stays with GSPMD.

The convolution (`causal_conv`) reads the K - 1 inputs before each token. Each device all-gathers the last K - 1
inputs (and segment ids) of every chunk of its group, a [2C, K - 1, channels] window, and runs the single-device
convolution on each of its chunks with its predecessor's window in front (the first chunk's: segment id -1, which
no token has). The segment ids decide, as on one device, which earlier inputs a token reads, so documents that start
inside a chunk or span chunks are convolved as they are unsplit: the same sums in the same order.

The rule (`rule`) is affine in its state. Per head, token t maps the state S [Dk, Dv] to

    S_t = A_t S_{t-1} + B_t,    A_t = g_t (I - beta_t k_t k_t^T),    B_t = beta_t k_t v_t^T

(A_t = 0 where t starts a document), so a chunk maps the state S0 entering it to S_end = P S0 + Q, and its
outputs o_t = S_t^T q_t to o_t = o0_t + S0^T W_t with W_t = P_t^T q_t, P_t = A_t ... A_1 (P = P_end). The rule is
column by column in Dv, so one run of the local rule (models/recurrent/gated_delta.py's chunked form, or the
kernel) on the values widened by Dk zero columns, from the state [0 | I], gives all four: its outputs are
[o0 | W] and its final state [Q | P]. Each device gathers every chunk's (P, Q) and its first and last segment
ids, composes them in the original chunk order (a scan over the 2C chunks, every device the same)

    S0_0 = 0,    S0_c = 0 if chunk c's first token starts a document, else P_{c-1} S0_{c-1} + Q_{c-1}

and corrects its two chunks' outputs by S0^T W. Equal to the unsplit rule up to float32 rounding: the chunk
boundaries and the order of the sums differ. Memory per device: its T / C tokens (W as wide as q) and the 2C
states and transitions [2C, N, Dk, Dv + Dk]; compute: the local rule at Dv + Dk value columns instead of Dv.

striped (token t on device t mod C) leaves no device a run of consecutive tokens; config/checks.py refuses it.

Letters as in gated_delta.py: B batch, T tokens, N heads, K key dim, V value dim; W devices of the group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.parallel import sharding

_TOKENS, _GATES = ("batch", "length", "heads", None), ("batch", "length", "heads")


def _group():
    """(mesh axes, ways) of the context group of the active mesh."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("the gated delta-net's context parallelism runs under sharding.activation_sharding")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    return axes, int(np.prod([mesh.shape[a] for a in axes]))


def _check_reorder(reorder: str):
    if reorder != "dual_chunk_swap":
        raise ValueError(f"the gated delta-net runs with context_parallel_reorder_strategy=dual_chunk_swap, not "
                         f"{reorder!r}: its recurrence needs runs of consecutive tokens on each device")


def _chunk_order(ways: int) -> np.ndarray:
    """Index into the gathered [W x 2] (device, slot) pieces of each chunk in the original order."""
    return np.array([2 * c if c < ways else 2 * (2 * ways - 1 - c) + 1 for c in range(2 * ways)])


def _in_original_order(x, axes, ways):
    """x [2, ...] (this device's two chunks) -> [2W, ...]: every chunk of the group in the original order."""
    gathered = jax.lax.all_gather(x, axes, axis=0, tiled=True)            # [W * 2, ...], (device, slot)
    return gathered[_chunk_order(ways)]


def _mine(x, axes, ways):
    """This device's two chunks, i and 2W - 1 - i, of x [2W, ...]."""
    i = jax.lax.axis_index(axes)
    return jnp.stack([x[i], x[2 * ways - 1 - i]])


def _as_chunks(x):
    """[B, T/C, ...] -> [2, B, T/2C, ...]: this device's two chunks first."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, 2, t // 2) + x.shape[2:]), 1, 0)


def _as_tokens(x):
    """[2, B, T/2C, ...] -> [B, T/C, ...]."""
    return jnp.moveaxis(x, 0, 1).reshape((x.shape[1], 2 * x.shape[2]) + x.shape[3:])


def _rows(x):
    """[2, B, ...] -> [2B, ...] (the local rule and convolution see the chunks as rows) and back."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _unrows(x):
    return x.reshape((2, x.shape[0] // 2) + x.shape[1:])


def causal_conv(x, w, segment_ids, *, local, reorder: str = "dual_chunk_swap"):
    """`local` (gated_deltanet.causal_conv) of x [B, T, C] by w [K, C] with x in the layout, split along T over the
    context axes: each chunk convolved with its predecessor's last K - 1 inputs in front (the module docstring)."""
    _check_reorder(reorder)
    axes, ways = _group()
    width = w.shape[0]

    def shard_fn(x, w, segment_ids):
        if width == 1:
            return local(x, w, segment_ids)
        xs, seg = _as_chunks(x), _as_chunks(segment_ids)                  # [2, B, T/2C, ...]
        if xs.shape[2] < width - 1:
            raise ValueError(f"the gated delta-net's convolution of {width} taps needs chunks of at least {width - 1} "
                             f"tokens under context parallelism, not {xs.shape[2]}")
        tails = _in_original_order(xs[:, :, -(width - 1):], axes, ways)   # [2W, B, K-1, C]
        tail_ids = _in_original_order(seg[:, :, -(width - 1):], axes, ways)
        before = jnp.concatenate([jnp.zeros_like(tails[:1]), tails[:-1]])  # chunk c's predecessor's window
        before_ids = jnp.concatenate([jnp.full_like(tail_ids[:1], -1), tail_ids[:-1]])
        wide = jnp.concatenate([_mine(before, axes, ways), xs], axis=2)
        wide_ids = jnp.concatenate([_mine(before_ids, axes, ways), seg], axis=2)
        out = local(_rows(wide), w, _rows(wide_ids))[:, width - 1:]
        return _as_tokens(_unrows(out))

    return sharding.run_in_shards(shard_fn, (x, w, segment_ids), (("batch", "length", None), (None, None),
                                                                   ("batch", "length")), ("batch", "length", None))


def rule(q, k, v, log_decay, beta, segment_ids, *, local, reorder: str = "dual_chunk_swap"):
    """The gated delta rule's output [B, T, N, V] for q, k [B, T, N, K], v [B, T, N, V], log_decay, beta [B, T, N]
    and segment_ids [B, T] in the layout, split along T over the context axes. local(q, k, v, log_decay, beta,
    segment_ids, initial_state) -> (o, final state) runs the rule on one device (gated_delta.chunked or the kernel,
    with its chunk size)."""
    _check_reorder(reorder)
    axes, ways = _group()

    def shard_fn(q, k, v, log_decay, beta, segment_ids):
        dtype, dk, dv = v.dtype, k.shape[-1], v.shape[-1]
        q, k, v, log_decay, beta, seg = (_as_chunks(x) for x in (q, k, v, log_decay, beta, segment_ids))
        rows = 2 * v.shape[1]
        widened = jnp.concatenate([v.astype(jnp.float32), jnp.zeros(v.shape[:-1] + (dk,), jnp.float32)], axis=-1)
        start = jnp.concatenate([jnp.zeros((rows, q.shape[3], dk, dv), jnp.float32),
                                 jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (rows, q.shape[3], dk, dk))], -1)
        o, final = local(_rows(q), _rows(k), _rows(widened), _rows(log_decay), _rows(beta), _rows(seg), start)
        o, final = _unrows(o.astype(jnp.float32)), _unrows(final.astype(jnp.float32))
        o0, w = o[..., :dv], o[..., dv:]                                  # [2, B, T/2C, N, V], [..., K]
        transitions = _in_original_order(final, axes, ways)               # [2W, B, N, K, V + K]: [Q | P]
        first = _in_original_order(seg[:, :, 0], axes, ways)              # [2W, B]
        last = _in_original_order(seg[:, :, -1], axes, ways)

        def step(s, xs):  # s: the state entering chunk c - 1; xs: chunk c - 1's [Q | P], chunk c's restart
            qp, restart = xs
            s = jnp.einsum("bnkj,bnjv->bnkv", qp[..., dv:], s) + qp[..., :dv]
            s = jnp.where(restart[:, None, None, None], 0.0, s)
            return s, s

        s_first = jnp.zeros(transitions.shape[1:-1] + (dv,), jnp.float32)
        _, entering = jax.lax.scan(step, s_first, (transitions[:-1], first[1:] != last[:-1]))
        entering = jnp.concatenate([s_first[None], entering])             # [2W, B, N, K, V]: S0 of every chunk
        o = o0 + jnp.einsum("cbtnk,cbnkv->cbtnv", w, _mine(entering, axes, ways))
        return _as_tokens(o).astype(dtype)

    return sharding.run_in_shards(shard_fn, (q, k, v, log_decay, beta, segment_ids),
                                  (_TOKENS,) * 3 + (_GATES,) * 2 + (("batch", "length"),), _TOKENS)

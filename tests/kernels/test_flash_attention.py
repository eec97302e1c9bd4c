"""Flash attention (Pallas, interpret mode on CPU) against the plain-jnp reference.

Every case compares the output and the gradients w.r.t. q, k and v (pulled back from a random
cotangent with jax.vjp) on fresh random inputs.
Tolerances: float32 inputs, |flash - ref| <= 1e-5 + 1e-5 * |ref| elementwise. bfloat16 inputs,
the reference runs in float32 on the same (bf16-valued) inputs and
|flash - ref| <= 2e-2 + 2e-2 * |ref|.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import slow_params
from maxtrain.models.attention import dot_product_attention, make_attention_mask
from maxtrain.kernels.flash_attention import flash_attention
from maxtrain.kernels.flash_tiles import Tuning, default_tuning, shared_memory_bytes

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 1
    q_len: int = 64
    kv_len: int = 64
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 32
    causal: bool = True
    packed: bool = False  # three documents per row, then trailing padding (segment id 0)
    block_q: int = 32
    block_k: int = 32
    dtype: type = jnp.float32
    sliding_window: int = 0
    soft_cap: float = 0.0
    scale: float | None = None
    tuning: tuple | None = None  # (fwd, dq, dkv) Tunings instead of default_tuning's


CASES = {
    # GQA 4:1, causal, packed rows, T = S = 100 not a multiple of either block, block_q != block_k.
    "gqa4_causal_packed_len100_f32": Case(batch=2, q_len=100, kv_len=100, packed=True,
                                          block_q=32, block_k=64),
    # MHA, non-causal, no segment ids, block_q > block_k.
    "mha_full_f32": Case(q_len=128, kv_len=128, kv_heads=4, causal=False, block_q=64,
                         block_k=32),
    # GQA 2:1, causal, head dim 64, lengths that are multiples of the blocks.
    "gqa2_causal_h64_f32": Case(batch=2, kv_heads=2, head_dim=64),
    # Queries and keys of different lengths, head dim 24 (padded to 32 inside), default blocks
    # (128, clamped to 64 for these short sequences).
    "cross_len_h24_default_blocks_f32": Case(q_len=50, kv_len=37, kv_heads=2, head_dim=24,
                                             causal=False, packed=False, block_q=128,
                                             block_k=128),
    "gqa4_causal_packed_len100_bf16": Case(q_len=100, kv_len=100, packed=True, block_q=32,
                                           block_k=64, dtype=jnp.bfloat16),
    "mha_full_packed_bf16": Case(kv_heads=4, causal=False, packed=True, dtype=jnp.bfloat16),
    # Gemma-style: a sliding window (24, narrower than a block, so whole blocks are skipped and
    # windows straddle blocks), logits soft-capped at 5 and a score scale other than H ** -0.5.
    "gqa2_window24_cap5_scale_packed_len100_f32": Case(batch=2, q_len=100, kv_len=100, kv_heads=2, packed=True,
                                                       block_q=32, block_k=16, sliding_window=24, soft_cap=5.0,
                                                       scale=0.3),
    "mha_window40_cap20_bf16": Case(q_len=128, kv_len=128, kv_heads=4, sliding_window=40, soft_cap=20.0,
                                    dtype=jnp.bfloat16),
    # Each kernel with its own tiles (as default_tuning makes them for head_dim 256): lengths are
    # padded to the largest block, block skipping is per kernel.
    "gqa4_own_tiles_per_kernel_len80_f32": Case(q_len=80, kv_len=80, packed=True, sliding_window=50,
                                                tuning=(Tuning(32, 16, 4, 2), Tuning(16, 32, 4, 2),
                                                        Tuning(16, 16, 4, 1))),
}


def _packed_segment_ids(batch, length, seed):
    """Three documents of random lengths per row, then trailing padding (id 0)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length - 4), size=3, replace=False))
        for doc, (start, stop) in enumerate(zip([0, *cuts[:2]], cuts)):
            ids[row, start:stop] = doc + 1
    return jnp.asarray(ids)


def _inputs(case: Case, seed: int):
    kq, kk, kv, kdo = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (case.batch, case.q_len, case.heads, case.head_dim), case.dtype)
    k = jax.random.normal(kk, (case.batch, case.kv_len, case.kv_heads, case.head_dim), case.dtype)
    v = jax.random.normal(kv, (case.batch, case.kv_len, case.kv_heads, case.head_dim), case.dtype)
    do = jax.random.normal(kdo, q.shape, case.dtype)
    if case.packed:
        assert case.q_len == case.kv_len, "packed cases are self-attention"
        q_seg = kv_seg = _packed_segment_ids(case.batch, case.q_len, seed)
    else:
        q_seg = kv_seg = None
    return q, k, v, do, q_seg, kv_seg


def _reference(q, k, v, q_seg, kv_seg, causal, sliding_window=0, soft_cap=0.0, scale=None):
    """Reference attention in float32 on the same input values."""
    if q_seg is None:
        q_seg = jnp.ones(q.shape[:2], jnp.int32)
        kv_seg = jnp.ones(k.shape[:2], jnp.int32)
    mask = make_attention_mask(q_seg, kv_seg, causal=causal, sliding_window=sliding_window)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return dot_product_attention(f32(q), f32(k), f32(v), mask, scale=scale, logits_soft_cap=soft_cap)


def _assert_close(name, actual, expected, tol):
    assert np.all(np.isfinite(np.asarray(actual, np.float32))), f"{name}: non-finite values"
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               atol=tol, rtol=tol, err_msg=name)


@pytest.mark.parametrize("name", slow_params(CASES, {"gqa4_causal_packed_len100_bf16", "mha_full_packed_bf16"}))
def test_matches_reference(name):
    case = CASES[name]
    q, k, v, do, q_seg, kv_seg = _inputs(case, seed=sorted(CASES).index(name))

    tuning = None if case.tuning is None else dict(zip(("fwd", "dq", "dkv"), case.tuning))

    def flash(q, k, v):
        return flash_attention(q, k, v, q_seg, kv_seg, causal=case.causal, block_q=case.block_q,
                               block_k=case.block_k, sliding_window=case.sliding_window,
                               logits_soft_cap=case.soft_cap, sm_scale=case.scale, tuning=tuning, interpret=True)

    def reference(q, k, v):
        return _reference(q, k, v, q_seg, kv_seg, case.causal, case.sliding_window, case.soft_cap, case.scale)

    out, grads = jax.jit(lambda q, k, v, do: (lambda o, f: (o, f(do)))(*jax.vjp(flash, q, k, v)))(q, k, v, do)
    assert out.shape == q.shape and out.dtype == q.dtype
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_vjp = jax.vjp(reference, f32(q), f32(k), f32(v))
    ref_grads = ref_vjp(f32(do))

    tol = TOLERANCE[case.dtype]
    for label, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                       (ref_out, *ref_grads)):
        assert actual.dtype == case.dtype, label
        _assert_close(f"{name}: {label}", actual, expected, tol)


def test_wrong_mask_is_detected():
    """The comparison is meaningful: a non-causal reference differs clearly from causal flash,
    and so does a reference that ignores the segment ids."""
    case = CASES["gqa4_causal_packed_len100_f32"]
    q, k, v, _, q_seg, kv_seg = _inputs(case, seed=0)
    out = flash_attention(q, k, v, q_seg, kv_seg, causal=True, block_q=32, block_k=64,
                          interpret=True)
    _assert_close("right mask", out, _reference(q, k, v, q_seg, kv_seg, causal=True), 1e-5)
    for wrong in (_reference(q, k, v, q_seg, kv_seg, causal=False),
                  _reference(q, k, v, None, None, causal=True)):
        assert float(jnp.max(jnp.abs(out - wrong))) > 0.1
        with pytest.raises(AssertionError):
            _assert_close("wrong mask", out, wrong, 1e-5)


def test_wrong_window_or_cap_is_detected():
    """A kernel that ignored the window, the cap or the scale (or had the window off by one) fails the comparison."""
    case = CASES["gqa2_window24_cap5_scale_packed_len100_f32"]
    q, k, v, _, q_seg, kv_seg = _inputs(case, seed=1)
    out = flash_attention(q, k, v, q_seg, kv_seg, sliding_window=24, logits_soft_cap=5.0, sm_scale=0.3,
                          block_q=32, block_k=16, interpret=True)
    _assert_close("right settings", out, _reference(q, k, v, q_seg, kv_seg, True, 24, 5.0, 0.3), 1e-5)
    for window, cap, scale in ((0, 5.0, 0.3), (25, 5.0, 0.3), (24, 0.0, 0.3), (24, 5.0, None)):
        wrong = _reference(q, k, v, q_seg, kv_seg, True, window, cap, scale)
        with pytest.raises(AssertionError):
            _assert_close(f"wrong window/cap/scale {window, cap, scale}", out, wrong, 1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("shared_memory", [232448, 166912, 101376])
def test_default_tuning_fits_the_shared_memory(head_dim, shared_memory):
    """Every kernel's tiles fit the target (by the model the lowering tests check on real targets),
    the requested blocks are kept where they fit, and only shrink where they must."""
    for dtype in (jnp.bfloat16, jnp.float16):
        tuning = default_tuning(head_dim, dtype, 128, 128, shared_memory)
        for kernel, t in tuning.items():
            assert shared_memory_bytes(kernel, t, head_dim, 2) <= shared_memory, (kernel, t)
            assert t.block_q <= 128 and t.block_k <= 128 and t.num_stages in (1, 2)
    h100 = default_tuning(128, jnp.bfloat16, 128, 128, 232448)
    assert all((t.block_q, t.block_k) == (128, 128) for t in h100.values())
    # head_dim 256 on an H100: the tiles that asked for 328,192 bytes (over the 232,448 available) shrink.
    assert shared_memory_bytes("fwd", Tuning(128, 128, 8, 2), 256, 2) >= 328192
    assert default_tuning(256, jnp.bfloat16, 128, 128, 232448)["fwd"] == Tuning(128, 64, 8, 2)


@pytest.mark.slow
def test_query_without_visible_keys_gives_zeros():
    """A query whose segment has no key gets output 0 and zero gradients, never NaN."""
    q, k, v, do, _, _ = _inputs(Case(q_len=32, kv_len=32, kv_heads=2), seed=7)
    q_seg = jnp.concatenate([jnp.ones((1, 24), jnp.int32), jnp.full((1, 8), 2, jnp.int32)], 1)
    kv_seg = jnp.ones((1, 32), jnp.int32)

    def flash(q, k, v):
        return flash_attention(q, k, v, q_seg, kv_seg, causal=True, block_q=16, block_k=16,
                               interpret=True)

    out, flash_vjp = jax.vjp(flash, q, k, v)
    dq, dk, dv = flash_vjp(do)
    assert np.all(np.asarray(out[:, 24:]) == 0)
    assert np.all(np.asarray(dq[:, 24:]) == 0)
    visible = q_seg[:, :24]
    _assert_close("visible rows", out[:, :24],
                  _reference(q[:, :24], k, v, visible, kv_seg, causal=True), 1e-5)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in (dk, dv))


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_q=48), "power of two"),
    (dict(block_k=8), "power of two"),
])
def test_rejects_bad_block_sizes(kwargs, message):
    q, k, v, _, _, _ = _inputs(Case(), seed=0)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, interpret=True, **kwargs)


def test_rejects_incompatible_heads():
    q = jnp.zeros((1, 32, 6, 32))
    k = jnp.zeros((1, 32, 4, 32))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, k, interpret=True)


def test_broken_backward_fails_the_comparison(monkeypatch):
    """A kernel whose backward forgets the soft-cap's derivative (1 - tanh^2) passes the forward
    comparison but fails the gradient one: the tolerance catches a wrong backward."""
    from maxtrain.kernels import flash_attention as flash_attention_module  # pylint: disable=import-outside-toplevel

    case = CASES["gqa2_window24_cap5_scale_packed_len100_f32"]
    q, k, v, do, q_seg, kv_seg = _inputs(case, seed=2)
    original = flash_attention_module._scores  # pylint: disable=protected-access

    def no_cap_slope(cfg, q, k, mask):
        s, _ = original(cfg, q, k, mask)
        return s, None

    monkeypatch.setattr(flash_attention_module, "_scores", no_cap_slope)

    def flash(q, k, v):
        return flash_attention(q, k, v, q_seg, kv_seg, sliding_window=24, logits_soft_cap=5.0, sm_scale=0.3,
                               block_q=32, block_k=16, interpret=True)

    out, vjp = jax.vjp(flash, q, k, v)
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, q_seg, kv_seg, True, 24, 5.0, 0.3), q, k, v)
    _assert_close("forward unaffected", out, ref_out, 1e-5)
    with pytest.raises(AssertionError):
        _assert_close("broken dq", vjp(do)[0], ref_vjp(do)[0], 1e-5)


@pytest.mark.parametrize("sliding_window", [0, 40])
def test_positions_skip_the_tiles_they_hide_exactly(monkeypatch, sliding_window):
    """Masking by position (context parallelism's load-balanced layouts: kernels/flash_tiles.py block_seen),
    the tiles that no query can see by the causal mask or the window run no matmul. Device 0's queries of a
    dual_chunk_swap layout over 2 devices (chunks 0 and 3 of 4) against every key in that layout: equal to the
    reference on the original order, and bitwise equal to every tile running."""
    from maxtrain.kernels import flash_tiles  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import context  # pylint: disable=import-outside-toplevel

    q, k, v, do, seg, _ = _inputs(Case(q_len=128, kv_len=128, kv_heads=2, packed=True), seed=3)
    order = jnp.asarray(context.layout(128, 2))
    positions = jnp.broadcast_to(order[None], seg.shape)
    q_dev, do_dev, seg_q, q_pos = q[:, order[:64]], do[:, order[:64]], seg[:, order[:64]], positions[:, :64]
    k_all, v_all, seg_kv = k[:, order], v[:, order], seg[:, order]

    def flash(q, k, v):
        return flash_attention(q, k, v, seg_q, seg_kv, causal=True, sliding_window=sliding_window, block_q=16,
                               block_k=16, q_positions=q_pos, kv_positions=positions, interpret=True)

    def run():
        out, vjp = jax.vjp(flash, q_dev, k_all, v_all)
        return (out, *vjp(do_dev))

    skipped = run()
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, seg, seg, True, sliding_window), f32(q), f32(k),
                               f32(v))
    ref_dq, ref_dk, ref_dv = ref_vjp(f32(do).at[:, order[64:]].set(0.0))  # only device 0's queries' gradient
    for label, actual, expected in zip(("out", "dq", "dk", "dv"), skipped,
                                       (ref_out[:, order[:64]], ref_dq[:, order[:64]], ref_dk[:, order],
                                        ref_dv[:, order])):
        _assert_close(label, actual, expected, 1e-4)
    monkeypatch.setattr(flash_tiles, "block_seen", lambda cfg, q_tokens, kv_tokens: None)  # every tile runs
    for label, a, b in zip(("out", "dq", "dk", "dv"), skipped, run()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=label)

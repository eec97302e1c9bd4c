"""maxtrain/kernels/splash_tables.py: splash's block tables built from block ranges, against splash's own
`_process_mask` (every array's values, dtype and shape), and the kernel built from them against splash's own maker
(Pallas' interpreter on CPU: output and gradients bitwise equal). Runs under jax 0.10.2 and 0.12 alike."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info_lib

from maxtrain.kernels import splash_tables


def _splash_own(mask, block_shape, is_dkv, shrink_grid=True):
    return mask_info_lib._process_mask(  # pylint: disable=protected-access
        masks.MultiHeadMask([mask] * 3), block_shape, is_dkv, shrink_grid=shrink_grid)


def _masks(length: int, kv_length: int):
    """The masks maxtrain gives splash: causal, sliding windows (causal or not), full; square and with an offset."""
    square = (length, length)
    return {
        "causal": masks.CausalMask(square),
        "full": masks.FullMask((length, kv_length)),
        "window_100": masks.LocalMask(square, (99, 0), 0),
        "window_128": masks.LocalMask(square, (127, 0), 0),
        "window_300_bidirectional": masks.LocalMask(square, (299, None), 0),
        "causal_offset": masks.CausalMask((length, kv_length), offset=kv_length - length),
        "window_offset": masks.LocalMask((length, kv_length), (199, 0), kv_length - length),
        "both_sides": masks.LocalMask(square, (50, 70), 0),
    }


CASES = [(length, kv, bq, bkv) for length, kv in ((256, 256), (512, 1024), (1024, 1024))
         for bq, bkv in ((128, 128), (128, 256), (256, 128), (256, 512)) if length % bq == 0 and kv % bkv == 0]


@pytest.mark.parametrize("length,kv_length,block_q,block_kv", CASES)
def test_tables_equal_splash_own(length, kv_length, block_q, block_kv):
    checked = 0
    for name, mask in _masks(length, kv_length).items():
        for is_dkv, shrink in itertools.product((False, True), (True, False)):
            ours = splash_tables.mask_info(mask, (block_q, block_kv), is_dkv, shrink_grid=shrink)
            why = splash_tables.compare(ours, _splash_own(mask, (block_q, block_kv), is_dkv, shrink))
            assert not why, f"{name} {'dkv' if is_dkv else 'fwd'} shrink={shrink}: {why}"
            checked += 1
    assert checked == 32


def test_a_perturbed_table_fails_the_comparison():
    """Control: one entry, a dtype, a missing q_sequence or an off-by-one window are each caught."""
    mask = masks.LocalMask((512, 512), (254, 0), 0)
    ours = splash_tables.mask_info(mask, (128, 128), False)
    theirs = _splash_own(mask, (128, 128), False)
    assert not splash_tables.compare(ours, theirs)
    info, function = ours
    data = np.array(info.data_next)
    data[0, -1, 0] += 1
    for wrong in (info._replace(data_next=data), info._replace(block_mask=info.block_mask.astype(np.int32)),
                  info._replace(q_sequence=None)):
        assert splash_tables.compare((wrong, function), theirs)
    wider = masks.LocalMask((512, 512), (255, 0), 0)  # the block two below the diagonal turns full
    assert splash_tables.compare(splash_tables.mask_info(wider, (128, 128), False),
                                 (theirs[0], wider.mask_function))


def test_an_unknown_format_is_refused(monkeypatch):
    """A splash whose tables differ from ours (another jax) stops the first kernel, naming this module."""
    own = mask_info_lib._process_mask  # pylint: disable=protected-access

    def other_format(*args, **kwargs):
        info, function = own(*args, **kwargs)
        return info._replace(data_next=info.data_next.astype(np.int32)), function
    monkeypatch.setattr(mask_info_lib, "_process_mask", other_format)
    splash_tables.check_format.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="splash_tables.py"):
            splash_tables.check_format()
    finally:
        splash_tables.check_format.cache_clear()


def test_other_masks_are_refused():
    with pytest.raises(TypeError, match="CausalMask, LocalMask and FullMask"):
        splash_tables.mask_info(masks.NumpyMask(np.tri(256, dtype=np.bool_)), (128, 128), False)


def test_tables_at_a_million_tokens_are_quick():
    """The 1M ulysses row's causal tables (blocks of 2,048): the shape splash's own pass would make, in numpy over
    512 x 512 blocks (no timing asserted: splash's own takes about 1,300 s of CPU here)."""
    info, _ = splash_tables.mask_info(masks.CausalMask((1 << 20, 1 << 20)), (2048, 2048), True)
    assert info.block_mask.shape == (1, 512, 512) and info.data_next.dtype == np.int16
    assert (info.block_mask[0, :, -1] == np.r_[np.zeros(511), 1]).all()  # dkv: the last key column, front-padded


def _kernel_inputs(length, heads, kv_heads, head_dim):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (heads, length, head_dim), jnp.float32)
    k, v = (jax.random.normal(key, (kv_heads, length, head_dim), jnp.float32) for key in keys[1:3])
    do = jax.random.normal(keys[3], (heads, length, head_dim), jnp.float32)
    seg = jnp.asarray(np.repeat(np.arange(3), [200, 200, length - 400]), jnp.int32)
    return q, k, v, do, splash.SegmentIds(q=seg, kv=seg)


def _run(kernel, q, k, v, do, segment_ids):
    out, pull = jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids=segment_ids), q, k, v)
    return (out, *pull(do))


@pytest.mark.slow
def test_kernel_output_and_gradients_are_splash_own():
    """Interpret mode: a causal sliding-window kernel (blocks skipped, partial and full) from our tables gives the
    output and dq, dk, dv of splash's own maker's bit for bit; control: another window does not."""
    q, k, v, do, seg = _kernel_inputs(512, 4, 2, 32)
    sizes = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                              block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    mask = masks.LocalMask((512, 512), (199, 0), 0)
    theirs = splash.make_splash_mha_single_device(masks.MultiHeadMask([mask] * 4), block_sizes=sizes, interpret=True)
    ours = splash_tables.make_kernel(mask, sizes, interpret=True)
    expected = jax.jit(lambda *a: _run(theirs, *a))(q, k, v, do, seg)
    for name, got, want in zip(("out", "dq", "dk", "dv"), jax.jit(lambda *a: _run(ours, *a))(q, k, v, do, seg),
                               expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    other = splash_tables.make_kernel(masks.LocalMask((512, 512), (99, 0), 0), sizes, interpret=True)
    assert not np.allclose(jax.jit(lambda *a: _run(other, *a))(q, k, v, do, seg)[0], expected[0], atol=1e-3)

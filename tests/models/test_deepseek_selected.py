"""DeepSeek Sparse Attention over the chosen keys alone (models/families/deepseek/selected.py): the same values and
gradients as MLA's plain form under the indexer's top-k mask, for any query block, with packed documents and
padding, each head's largest logit for QK-clip, and never a key of another document; the selected-key Pallas kernel
(kernels/selected_attention.py, interpret mode) in its place gives the plain form's numbers, per shard over batch and
heads and in a whole model (attention=flash), and autoselected takes it on GPUs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import attention as attention_lib
from maxtrain.models.families.deepseek import indexer, mla, selected
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.parallel import sharding

B, T, N, HN, HR, HV, C, I, E = 2, 32, 3, 8, 4, 6, 10, 4, 8
TOPK = 6
SCALE = (HN + HR) ** -0.5
# two documents then padding (segment 0) in the first row; one document in the second
SEGMENTS = jnp.asarray([[1] * 11 + [2] * 15 + [0] * 6, [1] * 32])


def _inputs(seed: int = 0, heads: int = N):
    keys = jax.random.split(jax.random.key(seed), 9)
    normal = lambda key, *shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    n = heads
    return dict(q_nope=normal(keys[0], B, T, n, HN), q_rope=normal(keys[1], B, T, n, HR), c=normal(keys[2], B, T, C),
                k_rope=normal(keys[3], B, T, HR), w_k=normal(keys[4], C, n, HN) * C**-0.5,
                w_v=normal(keys[5], C, n, HV) * C**-0.5, index_q=normal(keys[6], B, T, I, E),
                index_w=normal(keys[7], B, T, I), index_k=normal(keys[8], B, T, E))


def _kept(x):
    """The indexer's top-k mask [B, T, S] as the plain form (and decoding) build it."""
    per_head = jax.nn.relu(jnp.einsum("BTIE,BSE->BTIS", x["index_q"], x["index_k"]) * E**-0.5)
    index = jnp.einsum("BTI,BTIS->BTS", x["index_w"], per_head)
    visible = attention_lib.make_attention_mask(SEGMENTS, SEGMENTS, causal=True)
    return indexer.top(index, visible, TOPK)


def _plain(x):
    """MLA's expanded form under the mask: k = [c W_k ; k_r] per head, v = c W_v (mla.attention's)."""
    k_nope = jnp.einsum("BSC,CNH->BSNH", x["c"], x["w_k"])
    k = jnp.concatenate([k_nope, jnp.broadcast_to(x["k_rope"][:, :, None], (B, T, N, HR))], axis=-1)
    v = jnp.einsum("BSC,CNV->BSNV", x["c"], x["w_v"])
    q = jnp.concatenate([x["q_nope"], x["q_rope"]], axis=-1)
    return attention_lib.dot_product_attention(q, k, v, _kept(x), scale=SCALE)


def _selected(x, block=None, with_max_logits=False, kernel=None):
    out = selected.attention(x["q_nope"], x["q_rope"], x["c"], x["k_rope"], x["w_k"], x["index_q"], x["index_w"],
                             x["index_k"], SEGMENTS, topk=TOPK, scale=SCALE, block=block,
                             with_max_logits=with_max_logits, kernel=kernel)
    o_c, head_max = out if with_max_logits else (out, None)
    out = jnp.einsum("BTNC,CNV->BTNV", o_c, x["w_v"])
    return (out, head_max) if with_max_logits else out


def test_the_top_k_really_drops_keys_here():
    kept = _kept(_inputs())
    visible = jnp.sum(attention_lib.make_attention_mask(SEGMENTS, SEGMENTS, causal=True), axis=-1)
    counts = jnp.sum(kept, axis=-1)
    assert int(jnp.max(counts)) == TOPK and bool(jnp.all(counts == jnp.minimum(visible, TOPK)))
    assert int(jnp.sum(counts < visible)) > 20  # queries that lose keys


# Blocks 1, 4 and 32 (T, T / 4 and one run of blocks to trace) took 13-29 s each of the default run's 30 s budget per
# test in CI; the default run keeps the whole sequence as one block (None), the slow tests every block size.
@pytest.mark.parametrize("block", [pytest.param(1, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(32, marks=pytest.mark.slow), None])
def test_values_and_gradients_equal_the_plain_form_under_the_mask(block):
    x = _inputs()
    cotangent = jax.random.normal(jax.random.key(7), (B, T, N, HV))
    real = (SEGMENTS > 0)[:, :, None, None]  # padding queries attend among padding: compared too

    def loss(fn):  # the values and the gradients from one compiled program (eager dispatch took 25-75 s a block)
        def f(params):
            out = fn({**x, **params})
            return jnp.sum(out * cotangent * real), out
        return jax.jit(jax.grad(f, has_aux=True))

    params = {k: x[k] for k in ("q_nope", "q_rope", "c", "k_rope", "w_k", "w_v")}
    want, plain_out = loss(_plain)(params)
    got, selected_out = loss(lambda y: _selected(y, block))(params)
    np.testing.assert_allclose(selected_out, plain_out, rtol=1e-5, atol=1e-5)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_query_never_reads_a_key_of_another_document():
    """Changing the first document's latents and RoPE keys leaves the second document's outputs exactly as they were,
    though its early queries see fewer than index_topk keys of their own."""
    x = _inputs()
    first = (SEGMENTS == 1)[:, :, None]
    y = {**x, "c": jnp.where(first, 100.0, x["c"]), "k_rope": jnp.where(first, -100.0, x["k_rope"])}
    second = SEGMENTS[0] == 2
    np.testing.assert_array_equal(_selected(x)[0][second], _selected(y)[0][second])


def test_each_heads_largest_logit_is_over_the_kept_keys():
    x = _inputs()
    _, head_max = _selected(x, block=8, with_max_logits=True)
    k_nope = jnp.einsum("BSC,CNH->BSNH", x["c"], x["w_k"])
    logits = (jnp.einsum("BTNH,BSNH->BNTS", x["q_nope"], k_nope)
              + jnp.einsum("BTNR,BSR->BNTS", x["q_rope"], x["k_rope"])) * SCALE
    want = jnp.max(jnp.where(_kept(x)[:, None], logits, -jnp.inf), axis=(0, 2, 3))
    np.testing.assert_allclose(head_max, want, rtol=1e-5)


def test_a_block_that_does_not_divide_the_sequence_is_refused():
    x = _inputs()
    with pytest.raises(ValueError, match=r"the query block \(5\) must divide the sequence \(32\)"):
        _selected(x, block=5)
    assert selected.query_block(4096) == 128 and selected.query_block(96) == 32 and selected.query_block(7) == 1


def test_each_run_of_query_blocks_scores_only_the_keys_before_its_end():
    """The indexer's top_k sorts, per run of blocks (selected.prefix_groups), the keys before the run's end alone:
    at 1,024 tokens in blocks of 128, runs of one block ending at 128, 256, ..., 1,024 keys, so the queries score
    on average 576 keys (9/16 of T), and the FLOPs formula counts that mean (selected.scored_keys)."""
    t, k = 1024, 16
    spec = jax.ShapeDtypeStruct
    args = (spec((1, t, 2, 4), jnp.float32), spec((1, t, 2, 4), jnp.float32), spec((1, t, 8), jnp.float32),
            spec((1, t, 4), jnp.float32), spec((8, 2, 4), jnp.float32), spec((1, t, 2, 4), jnp.float32),
            spec((1, t, 2), jnp.float32), spec((1, t, 4), jnp.float32), spec((1, t), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda *a: selected.attention(*a, topk=k, scale=1.0))(*args)
    sorted_widths = sorted(shape[-1] for shape in _top_k_operands(jaxpr.jaxpr))
    assert selected.prefix_groups(t, 128) == [(i * 128, (i + 1) * 128) for i in range(8)]
    assert sorted_widths == [128 * (i + 1) for i in range(8)], sorted_widths
    assert selected.scored_keys(t) == pytest.approx(576.0)
    assert selected.prefix_groups(96, 32) == [(0, 32), (32, 64), (64, 96)]  # fewer blocks than runs: one each
    assert selected.scored_keys(4096) == pytest.approx(4096 * 9 / 16)


def _top_k_operands(jaxpr) -> list[tuple]:
    """The operand shapes of every top_k in a jaxpr, its loops' and checkpoints' bodies included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "top_k":
            shapes.append(eqn.invars[0].aval.shape)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr's, or a Jaxpr
            if hasattr(inner, "eqns"):
                shapes += _top_k_operands(inner)
    return shapes


@pytest.mark.slow  # ~15 s of CPU: the kernel's three interpreted Pallas calls, compiled
def test_the_kernel_per_shard_gives_the_plain_forms_values_gradients_and_largest_logits():
    """The selected-key kernel (interpret mode) on `chosen`'s keys, inside shard_map with the batch over 2 devices and
    4 heads over 2: the plain form's o_c, gradients and per-head largest logits, with the documents and the padding,
    in runs of 4-query blocks (the first run scores 4 keys, fewer than index_topk = 6: its last slots not kept)."""
    x = _inputs(heads=4)
    cotangent = jax.random.normal(jax.random.key(7), (B, T, 4, C))
    params = {k: x[k] for k in ("q_nope", "q_rope", "c", "k_rope", "w_k")}

    def loss(kernel):
        def f(params):
            y = {**x, **params}
            o_c, head_max = selected.attention(y["q_nope"], y["q_rope"], y["c"], y["k_rope"], y["w_k"], y["index_q"],
                                               y["index_w"], y["index_k"], SEGMENTS, topk=TOPK, scale=SCALE, block=4,
                                               with_max_logits=True, kernel=kernel)
            return jnp.sum(o_c * cotangent), (o_c, head_max)
        return jax.jit(jax.value_and_grad(f, has_aux=True))

    mesh = sharding.mesh_of(jax.devices()[:4], data=2, tensor=2)
    with sharding.activation_sharding(mesh, [["batch", "data"], ["heads", "tensor"]]):
        (_, (got, got_max)), got_grads = loss("cpu")(params)
    (_, (want, want_max)), want_grads = loss(None)(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_max, want_max, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)


def _tiny_v32(*overrides):
    """A DeepSeek-V3.2-shaped model (test_deepseek.py's: MLA, experts, the indexer keeping 3 keys) over 16 tokens."""
    from test_deepseek import SPARSE, tiny  # pylint: disable=import-outside-toplevel  # tests/models/ is on sys.path

    return tiny("max_target_length=16", *SPARSE, *overrides)


def test_autoselected_takes_the_kernel_on_a_gpu_and_a_tpu_and_says_why():
    config = _tiny_v32("attention=autoselected", "dtype=bfloat16")
    gpu = Runtime.from_config(config, "gpu", capability="9.0")
    assert gpu.attention == "flash"
    assert ("attention flash (Pallas Triton) (autoselected for gpu) [flash: the selected-key Pallas kernel (Triton): "
            "the indexer keeps index_topk=3 of 16 keys per query") in gpu.describe()
    tpu = Runtime.from_config(config, "tpu")
    assert tpu.attention == "flash"
    assert ("attention flash (Pallas Mosaic, selected keys) (autoselected for tpu) [flash: the selected-key Pallas "
            "kernel (Mosaic): the indexer keeps index_topk=3 of 16 keys per query") in tpu.describe()
    cpu = Runtime.from_config(config, "cpu")
    assert cpu.attention == "dot_product"
    assert ("[dot_product: the indexer keeps index_topk=3 of 16 keys per query, read in plain jnp by query blocks "
            "(the selected-key Pallas kernel runs on GPUs and TPUs") in cpu.describe()
    dense = Runtime.from_config(config.replace(index_topk=16), "gpu", capability="9.0")
    assert "selected-key" not in dense.attention_reason  # every key kept: MLA's dense kernels choose as any model's


@pytest.mark.slow  # ~15 s of CPU: the kernel's interpreted Pallas calls in two layers, compiled
def test_a_model_with_the_kernel_gives_the_plain_forms_logits_and_gradients():
    """attention=flash on CPU: the selected-key kernel in interpret mode in both layers, with two documents packed in
    one row and padding in the other, 16 tokens of which each query keeps 3: the plain form's logits (float32,
    1e-5 relative) and gradients."""
    config = _tiny_v32()
    model = Model.bind(config)
    params = jax.jit(model.init_params)(jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    segments = jnp.asarray([[1] * 7 + [2] * 9, [1] * 13 + [0] * 3])
    positions = jnp.asarray([list(range(7)) + list(range(9)), list(range(16))])
    weights = jax.random.normal(jax.random.key(2), (2, 16, config.vocab_size))

    def run(attention):
        rt = Runtime.from_config(config.replace(attention=attention), "cpu")

        def loss(params):
            logits = model.forward(params, ids, positions, segments, rt)[0]
            return jnp.sum(logits * weights), logits
        return rt, loss

    rt, kernel_loss = run("flash")
    assert rt.attention == "flash" and "selected-key Pallas kernel (interpret mode" in rt.attention_reason
    assert "selected_attention_fwd" in str(jax.make_jaxpr(kernel_loss)(params))  # the kernel, not the plain form
    (_, got), got_grads = jax.jit(jax.value_and_grad(kernel_loss, has_aux=True))(params)
    (_, want), want_grads = jax.jit(jax.value_and_grad(run("dot_product")[1], has_aux=True))(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = functools.reduce(lambda tree, key: tree[key.key], path, want_grads)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w)) + 1e-30),
                                   err_msg=jax.tree_util.keystr(path))


def _kl_selected(x, block=None, kernel=None):
    """The sparse stage's indexer KL over each query's selected keys (selected.attention's indexer_kl)."""
    return selected.attention(x["q_nope"], x["q_rope"], x["c"], x["k_rope"], x["w_k"], x["index_q"], x["index_w"],
                              x["index_k"], SEGMENTS, topk=TOPK, scale=SCALE, block=block, kernel=kernel,
                              indexer_kl=True)[1]


def _kl_plain(x, mask):
    """indexer.kl_to_attention as the plain form takes it: the head-averaged target of MLA's expanded form and the
    indexer's full scores [B, T, S], over the keys of `mask`."""
    k_nope = jnp.einsum("BSC,CNH->BSNH", x["c"], x["w_k"])
    k = jnp.concatenate([k_nope, jnp.broadcast_to(x["k_rope"][:, :, None], (B, T, N, HR))], axis=-1)
    q = jnp.concatenate([x["q_nope"], x["q_rope"]], axis=-1)
    target = mla.head_averaged_probabilities(q, k, mask, SCALE)
    return indexer.kl_to_attention(target, indexer.combine(x["index_q"], x["index_w"], x["index_k"]), mask, SEGMENTS)


@pytest.mark.parametrize("block", [pytest.param(1, marks=pytest.mark.slow), 4, None])
def test_the_indexer_kl_over_the_selected_keys_is_the_plain_forms(block):
    """Over the selected keys alone, block by block, with the documents and the padding: the plain form's KL
    (the target over the top-k mask) and its gradients on the indexer's operands, none on the attention's; the KL
    over every visible key (the dense warm-up's) is another number."""
    x = _inputs(1)
    kept = _kept(x)
    indexer_ops = ("index_q", "index_w", "index_k")
    attention_ops = ("q_nope", "q_rope", "c", "k_rope", "w_k")
    got, got_grads = jax.jit(jax.value_and_grad(lambda y: _kl_selected({**x, **y}, block)))(x)
    want, want_grads = jax.jit(jax.value_and_grad(lambda y: _kl_plain({**x, **y}, kept)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name in indexer_ops:
        assert np.any(np.asarray(want_grads[name])), name
        np.testing.assert_allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)
    for name in attention_ops:
        assert not np.any(np.asarray(got_grads[name])), name
    every_key = _kl_plain(x, attention_lib.make_attention_mask(SEGMENTS, SEGMENTS, causal=True))
    assert abs(float(every_key) - float(want)) > 1e-2 * float(want), (every_key, want)


def test_beside_the_kernel_the_indexer_kl_is_the_plain_forms():
    """With the selected-key kernel (interpret mode) the KL comes from a plain-jnp side computation over the same
    keys: the plain form's value and indexer gradients, in runs of 4-query blocks."""
    x = _inputs(1)
    got, got_grads = jax.jit(jax.value_and_grad(lambda y: _kl_selected({**x, **y}, 4, kernel="cpu")))(x)
    want, want_grads = jax.jit(jax.value_and_grad(lambda y: _kl_plain({**x, **y}, _kept(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name in want_grads:
        np.testing.assert_allclose(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)

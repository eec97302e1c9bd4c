import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params

from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.models import blocks
from maxtrain.models import rope as rope_lib
from maxtrain import config as config_lib
from maxtrain.config import settings as settings_lib
from maxtrain.config import load_config, with_overrides


def setup(*overrides):
    cfg = load_config([BASE_YML, *with_overrides(TINY, *overrides)])
    rt = Runtime.from_config(cfg)
    params = Model.bind(cfg).init_params(jax.random.key(0))
    return cfg, rt, params


def logits_of(cfg, rt, params, tokens, positions=None, segment_ids=None):
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions is None else jnp.asarray(positions)
    segment_ids = jnp.ones_like(tokens) if segment_ids is None else jnp.asarray(segment_ids)
    return Model.bind(cfg).forward(params, tokens, positions, segment_ids, rt)[0]


def test_specs_declare_every_axis():
    for name in config_lib.preset_names():
        cfg = load_config([BASE_YML, f"model_name={name}"])
        for spec in jax.tree.leaves(Model.bind(cfg).param_specs, is_leaf=is_spec):
            assert len(spec.shape) == len(spec.axes)


def test_shapes_dtypes_and_tied_embeddings():
    cfg, rt, params = setup("logits_via_embedding=true")
    assert "output" not in params
    out = logits_of(cfg, rt, params, np.ones((2, 8), np.int32))
    assert out.shape == (2, 8, cfg.vocab_size) and out.dtype == jnp.float32
    cfg, rt, params = setup("dtype=bfloat16")
    assert params["layers"]["decoder"]["wq"].dtype == jnp.float32  # master weights stay float32
    assert logits_of(cfg, rt, params, np.ones((1, 8), np.int32)).dtype == jnp.float32


def test_causal_future_tokens_do_not_change_the_past():
    cfg, rt, params = setup()
    rng = np.random.default_rng(0)
    a = rng.integers(4, cfg.vocab_size, (1, 16))
    b = a.copy()
    b[0, 10:] = rng.integers(4, cfg.vocab_size, 6)
    la, lb = logits_of(cfg, rt, params, a), logits_of(cfg, rt, params, b)
    np.testing.assert_array_equal(la[:, :10], lb[:, :10])
    assert not np.allclose(la[:, 10:], lb[:, 10:])


def test_packed_document_equals_the_document_alone():
    """Two documents in one row: each sees only itself, and positions restart per document."""
    cfg, rt, params = setup()
    rng = np.random.default_rng(1)
    doc1, doc2 = rng.integers(4, cfg.vocab_size, 7), rng.integers(4, cfg.vocab_size, 9)
    packed = np.concatenate([doc1, doc2])[None]
    positions = np.concatenate([np.arange(7), np.arange(9)])[None]
    segments = np.array([[1] * 7 + [2] * 9])
    packed_logits = logits_of(cfg, rt, params, packed, positions, segments)
    alone1 = logits_of(cfg, rt, params, doc1[None])
    alone2 = logits_of(cfg, rt, params, doc2[None])
    np.testing.assert_allclose(packed_logits[0, :7], alone1[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(packed_logits[0, 7:], alone2[0], atol=2e-5, rtol=2e-5)


def test_scan_and_unrolled_layers_agree():
    cfg, rt, params = setup()
    tokens = np.random.default_rng(2).integers(4, cfg.vocab_size, (2, 16))
    scanned = logits_of(cfg, rt, params, tokens)
    unrolled = logits_of(cfg.replace(scan_layers=False), rt, params, tokens)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(pq, pk):
        rope = rope_lib.Rope(theta=10000.0)
        rq = rope_lib.apply(q, *rope_lib.tables(jnp.array([[pq]]), rope, 16))
        rk = rope_lib.apply(k, *rope_lib.tables(jnp.array([[pk]]), rope, 16))
        return float(jnp.sum(rq * rk))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


@pytest.mark.parametrize("rope", [rope_lib.Rope(theta=500000.0),
                                  rope_lib.Rope(theta=10000.0, type="yarn", factor=4.0,
                                                original_max_position_embeddings=64)])
def test_rope_host_table_matches_the_computed_angles(rope):
    """The CPU path reads cos/sin from a host table of positions [0, T); it agrees with computing them in
    the step (to float32 rounding, yarn's attention factor included), and a position outside the table
    reads NaN instead of a wrong angle."""
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 0, 1, 2, 7, 6]])
    computed = rope_lib.tables(positions, rope, 32)
    from_table = jax.jit(lambda p: rope_lib.tables(p, rope, 32, num_positions=8))(positions)
    for a, b in zip(computed, from_table):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-6)
    cos, sin = rope_lib.tables(positions.at[1, 2].set(8), rope, 32, num_positions=8)
    assert np.isnan(np.asarray(cos)[1, 2]).all() and np.isnan(np.asarray(sin)[1, 2]).all()
    assert np.isfinite(np.asarray(cos)[1, 3]).all()


def test_rope_table_only_on_cpu_and_within_its_budget():
    assert rope_lib.table_positions(256, 64, "cpu") == 256
    assert rope_lib.table_positions(8192, 128, "cpu") == 8192  # 4 MiB of cos and sin
    assert rope_lib.table_positions(16384, 128, "cpu") is None
    assert rope_lib.table_positions(256, 64, "tpu") is None and rope_lib.table_positions(256, 64, "gpu") is None


def test_cpu_train_step_computes_no_sine_or_cosine():
    """The compiled CPU step reads RoPE's cos/sin from the table: no sincos per element of q and k."""
    from maxtrain.training import builder
    cfg = load_config([BASE_YML, *with_overrides(TINY, "dataset_type=synthetic", "enable_checkpointing=false")])
    hlo = builder.build(cfg).compile().as_text()
    assert " rsqrt(" in hlo  # the text is the step's: its norms are there
    assert not re.findall(r"f32\[\d[\d,]*\]\S* (?:sine|cosine)\(", hlo)  # (the schedule's scalar cosine stays)


def test_rms_norm_in_float32():
    x = jnp.asarray([[3.0, 4.0]], jnp.bfloat16)
    out = blocks.rms_norm(x, jnp.ones(2), 0.0)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), [[3 / np.sqrt(12.5), 4 / np.sqrt(12.5)]], rtol=1e-2)


def test_loss_ignores_zero_weight_tokens():
    cfg, rt, params = setup()
    rng = np.random.default_rng(4)
    tokens = rng.integers(4, cfg.vocab_size, (1, 17))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.arange(16)[None],
             "segment_ids": np.ones((1, 16), np.int32), "loss_weights": np.r_[np.ones(10), np.zeros(6)][None]}
    loss, weight, _ = Model.bind(cfg).loss_fn(params, batch, rt)
    batch2 = {**batch, "targets": np.concatenate([tokens[:, 1:11], np.full((1, 6), 5)], axis=1)}
    loss2, _, _ = Model.bind(cfg).loss_fn(params, batch2, rt)
    assert float(weight) == 10.0 and float(loss) == float(loss2)


# --------------------------------------------------------------------------------------------
# Layer types, segments and the aux channel (maxtrain/models/decoder.py)
# --------------------------------------------------------------------------------------------

from maxtrain.models import decoder  # noqa: E402
from maxtrain.models.layers import LayerType  # noqa: E402


def test_segments_scan_repeating_groups():
    s, f = LayerType(attention="sliding", window=4, rope="local"), LayerType()
    gemma3_1b = [s if (i + 1) % 6 else f for i in range(26)]
    plan = [(seg.start, len(seg.period), seg.repeats) for seg in decoder.plan_segments(gemma3_1b)]
    assert plan == [(0, 6, 4), (24, 1, 2)]
    assert [(seg.start, len(seg.period), seg.repeats) for seg in decoder.plan_segments([f] * 16)] == [(0, 1, 16)]
    alternating = [s, f] * 5 + [s]
    assert [(seg.start, len(seg.period), seg.repeats) for seg in decoder.plan_segments(alternating)] == [(0, 2, 5), (10, 1, 1)]
    dense_first = [LayerType("dense")] + [LayerType("moe", mlp="moe")] * 7
    assert [(seg.start, len(seg.period), seg.repeats) for seg in decoder.plan_segments(dense_first)] == [(0, 1, 1), (1, 1, 7)]


def test_sparse_mixers_are_layer_kinds_with_their_k():
    """DeepSeek-V3.2's indexer and DeepSeek-V4's compressor are LayerTypes of their own (mixer, compress, topk),
    resolved once from the config; the keys a query reads follow from them; inconsistent kinds are refused."""
    from maxtrain import config as config_lib
    from maxtrain.models import layers
    from maxtrain.models.model import Model

    def kinds(*overrides):
        return Model.bind(config_lib.load_config(["configs/base.yml", *overrides])).layer_types

    assert {(t.mixer, t.topk) for t in kinds("model_name=deepseek3.2-tiny")} == {("dsa", 64)}
    assert {(t.mixer, t.topk) for t in kinds("model_name=deepseek3.2-tiny", "index_n_heads=0")} == {("mla", 0)}
    v4 = {(t.kind.split("_")[0], t.mixer, t.compress, t.topk, t.window) for t in kinds("model_name=deepseek4-tiny")}
    assert v4 == {("sliding", "compressed", 0, 0, 32), ("csa", "compressed", 4, 8, 32), ("hca", "compressed", 16, 0, 32)}
    dsa = LayerType(kind="moe", mixer="dsa", topk=4, mlp="moe")
    assert layers.attended_keys(4, dsa) == 2.5  # at or under k every visible key, as full attention
    assert layers.attended_keys(10, dsa) == (4 * 5 / 2 + 6 * 4) / 10 and layers.attended_keys(10, dsa, True) == 4.0
    for bad in (dict(mixer="dsa"), dict(mixer="mla", topk=8), dict(mixer="attention", compress=4),
                dict(mixer="compressed", topk=8, attention="sliding", window=4)):
        with pytest.raises(ValueError, match="LayerType"):
            LayerType(**bad)


@pytest.mark.parametrize("family, layers", slow_params([("gemma3", 8), ("gemma2", 5), ("mistral", 3)], {"gemma3-8"},
                                                  ids=["gemma3-8", "gemma2-5", "mistral-3"]))
def test_mixed_layer_stacks_scan_like_unrolled(family, layers):
    """Sliding and global layers under scan (groups + remainder) give the unrolled stack's logits."""
    cfg, rt, params = setup(f"decoder_block={family}", f"base_num_decoder_layers={layers}", "sliding_window_size=5",
                            "local_rope_max_timescale=100.0" if family == "gemma3" else "rope_max_timescale=10000.0",
                            "remat_policy=full")
    tokens = np.random.default_rng(2).integers(4, cfg.vocab_size, (2, 16))
    scanned = logits_of(cfg, rt, params, tokens)
    unrolled = logits_of(cfg.replace(scan_layers=False), rt, params, tokens)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=1e-5)
    full = logits_of(cfg.replace(sliding_window_size=0), rt, params, tokens)
    assert not np.allclose(scanned, full, atol=1e-3)  # the window matters at 16 tokens


def test_aux_losses_reach_the_objective_and_the_metrics(monkeypatch):
    """A family whose layers report aux scalars: they are summed over the stack, `*_loss` entries join the
    objective, and every entry reaches the train step's metrics, with no plumbing in between."""
    import types

    from maxtrain import config as config_lib
    from maxtrain.models import families
    from maxtrain.training import optimizer, train_step
    from maxtrain.models.families import llama

    def layer(x, p, inputs, layer_type, model, rt):
        x, aux = llama.MODEL.layer(x, p, inputs, layer_type, model, rt)
        energy = jnp.mean(jnp.square(x.astype(jnp.float32)))
        return x, {**aux, "toy_loss": 0.01 * energy, "toy_energy": energy}

    toy = dataclasses.replace(llama.MODEL, layer=layer)  # the family contract, with one layer of its own
    monkeypatch.setitem(families.FAMILIES, "toy", toy)
    block = config_lib.table()["decoder_block"]  # the settings table admits the new family too
    monkeypatch.setitem(config_lib.table(), "decoder_block", dataclasses.replace(
        block, allowed=settings_lib.parse_allowed(block.allowed.text + " | toy", block.default, "test")))
    cfg, rt, params = setup("decoder_block=toy")
    rng = np.random.default_rng(5)
    tokens = rng.integers(4, cfg.vocab_size, (1, 2, 17)).astype(np.int32)
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "positions": np.tile(np.arange(16), (1, 2, 1)),
             "segment_ids": np.ones((1, 2, 16), np.int32), "loss_weights": np.ones((1, 2, 16), np.float32)}
    micro = {k: v[0] for k, v in batch.items()}
    model = Model.bind(cfg)
    ce, weight, aux = model.loss_fn(params, micro, rt)
    per_layer = []  # the energies layer by layer, unrolled by hand
    x = llama.MODEL.embed(params, micro["inputs"], cfg, rt)
    inputs = blocks.LayerInputs(micro["positions"], micro["segment_ids"],
                                rope_lib.named_tables(micro["positions"], cfg, decoder.rope_widths(model)))
    for i, lt in enumerate(model.layer_types):
        x, layer_aux = layer(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]["decoder"]), inputs, lt, model, rt)
        per_layer.append(float(layer_aux["toy_energy"]))
    assert float(aux["toy_energy"]) == pytest.approx(sum(per_layer), rel=1e-5)  # summed over the stack
    assert float(decoder.objective(ce, weight, aux)) == pytest.approx(float(ce) + float(weight) * 0.01 * sum(per_layer),
                                                                      rel=1e-5)
    tx = optimizer.make_optimizer(cfg, model)
    state = {**train_step.init_state(cfg, model, rt, tx, jax.random.key(0)), "params": params}
    _, metrics = jax.jit(train_step.make_train_step(cfg, model, rt, tx))(state, batch)
    assert float(metrics["aux/toy_energy"]) == pytest.approx(sum(per_layer), rel=1e-4)
    assert float(metrics["loss"]) == pytest.approx(float(ce) / float(weight), rel=1e-5)  # the loss stays the CE


def test_unstack_gradient_is_one_stack_not_padded_slices():
    """ops.unstack (the unrolled layers' cut of each stacked weight): the same values and gradient as
    slicing, with the slices' gradients stacked, where autodiff of a[i] pads each one to [L, ...]."""
    from maxtrain.models import ops
    a = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 5)), jnp.float32)

    def loss(cut):
        return lambda a: sum(jnp.sum(jnp.sin(x) * (i + 1)) for i, x in enumerate(cut(a)))

    sliced = lambda a: tuple(a[i] for i in range(a.shape[0]))
    for x, y in zip(ops.unstack(a), sliced(a)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_allclose(np.asarray(jax.grad(loss(ops.unstack))(a)), np.asarray(jax.grad(loss(sliced))(a)),
                               rtol=1e-6)
    primitives = lambda f: {e.primitive.name for e in jax.make_jaxpr(jax.grad(f))(a).jaxpr.eqns}
    assert "pad" in primitives(loss(sliced)) and "pad" not in primitives(loss(ops.unstack))


def test_cpu_dense_weight_gradient_is_a_plain_matmul():
    """ops.dense(backend="cpu"): the same values and gradients as the plain product, with the weight
    gradient computed as x^T . g from an x^T of its own: no matmul in the compiled gradient contracts
    a transposed operand (which XLA:CPU leaves to slower code than its matmul library)."""
    from maxtrain.models import ops
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 4, 6)), jnp.float32)

    def grads(backend):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(ops.dense(x, w, backend=backend))),
                                          argnums=(0, 1)))

    (value, (dx, dw)), (ref_value, (ref_dx, ref_dw)) = grads("cpu")(x, w), grads(None)(x, w)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(ref_dx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(ref_dw), rtol=1e-5, atol=1e-5)

    def transposed_lhs_dots(backend):
        return re.findall(r" dot\(.*lhs_contracting_dims=\{0\}", grads(backend).lower(x, w).compile().as_text())

    assert transposed_lhs_dots(None) and not transposed_lhs_dots("cpu")


def test_rms_norm_spans_the_scale_s_axes_and_a_scalar_scale_the_last():
    """[N, H] scales normalize over all heads' features (OLMo 3), [H] over each head's, and a scalar scale (no learned
    one, Llama 4's L2 qk-norm) over the last axis, never over none."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4, 8)), jnp.float32)
    per_head = blocks.rms_norm(x, jnp.ones((8,)), 1e-6)
    np.testing.assert_allclose(blocks.rms_norm(x, jnp.ones(()), 1e-6), per_head, rtol=1e-6)
    np.testing.assert_allclose(jnp.mean(jnp.square(per_head), axis=-1), 1.0, rtol=1e-4)
    over_heads = blocks.rms_norm(x, jnp.ones((4, 8)), 1e-6)
    np.testing.assert_allclose(jnp.mean(jnp.square(over_heads), axis=(-2, -1)), 1.0, rtol=1e-4)

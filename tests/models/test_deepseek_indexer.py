"""Training DeepSeek-V3.2's lightning indexer (indexer_training, models/families/deepseek/): the KL loss against its
formula, which weights each loss reaches (the KL the indexer's alone, the language-model loss the rest), the dense
warm-up training the indexer alone while its KL falls, the sparse stage training both, and what is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.models.families.deepseek import indexer, indexer_training, selected
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import builder

DEEPSEEK = ["decoder_block=deepseek", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
            "first_num_dense_layers=1", "shared_experts=1", "routed_bias=true", "base_num_query_heads=4",
            "base_num_kv_heads=4", "q_lora_rank=8", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=4",
            "head_dim=12", "v_head_dim=10", "rope_interleave=true", "load_balance_loss_weight=0",
            "index_n_heads=4", "index_head_dim=8", "index_topk=6"]


def tiny(*overrides):
    return load_config(with_overrides(with_overrides([BASE_YML, *TINY], *DEEPSEEK), *overrides))


def test_kl_is_the_formula_over_the_masked_keys_and_real_queries():
    rng = np.random.default_rng(0)
    b, t = 2, 5
    mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    mask[1, 3, 1] = False  # a key the stage does not keep
    target = rng.random((b, t, t)) * mask
    target /= target.sum(-1, keepdims=True)
    index = rng.standard_normal((b, t, t)).astype(np.float32)
    seg = np.array([[1] * t, [1] * 4 + [0]])  # the last query of row 1 is padding
    want, n = 0.0, 0
    for i in range(b):
        for q in range(t):
            if seg[i, q] == 0:
                continue
            keys = mask[i, q]
            log_q = index[i, q, keys] - np.log(np.exp(index[i, q, keys]).sum())
            p = target[i, q, keys]
            want += np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - log_q), 0))
            n += 1
    got = indexer.kl_to_attention(jnp.asarray(target, jnp.float32), jnp.asarray(index), jnp.asarray(mask),
                                  jnp.asarray(seg))
    np.testing.assert_allclose(float(got), want / n, rtol=1e-5)


def batch_of(config, rows: int = 2):
    tokens = jax.random.randint(jax.random.key(1), (rows, config.max_target_length), 0, config.vocab_size)
    return {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1),
            "positions": jnp.broadcast_to(jnp.arange(config.max_target_length), tokens.shape),
            "segment_ids": jnp.ones_like(tokens), "loss_weights": jnp.ones(tokens.shape, jnp.float32)}


def is_indexer(path) -> bool:
    return str(getattr(path[-1], "key", "")).startswith("index_")


@pytest.mark.parametrize("stage", [pytest.param("dense_warmup", marks=pytest.mark.slow), "sparse"])
def test_the_kl_trains_the_indexer_alone_and_the_lm_loss_never_reaches_it(stage):
    """The indexer's input is detached and its selection has no gradient: the KL's gradient is zero on every weight
    but the indexer's (and not zero there), the language-model loss's zero on the indexer's. 16 tokens keeping 6:
    the sparse stage runs over the selected keys (selected.py), the warm-up the plain form."""
    config = tiny(f"indexer_training={stage}", "max_target_length=16")
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    params = jax.jit(model.init_params)(jax.random.key(0))  # one compile, not op-by-op dispatch
    batch = batch_of(config)

    def parts(p):
        loss, _, aux = model.loss_fn(p, batch, rt)
        return loss, aux["indexer_loss"]

    lm_grads, kl_grads = jax.jit(lambda p: (jax.grad(lambda q: parts(q)[0])(p), jax.grad(lambda q: parts(q)[1])(p)))(
        params)
    for (path, lm), kl in zip(jax.tree_util.tree_flatten_with_path(lm_grads)[0], jax.tree.leaves(kl_grads)):
        name = jax.tree_util.keystr(path)
        if is_indexer(path):
            assert not np.any(np.asarray(lm)), name
            assert np.any(np.asarray(kl)), name
        else:
            assert not np.any(np.asarray(kl)), name


def train(stage, steps, *overrides):
    run = builder.build(tiny(f"indexer_training={stage}", "max_target_length=16", "learning_rate=0.01",
                             "warmup_steps_fraction=0", "lr_schedule_type=constant", *overrides),
                        devices=jax.devices()[:1])
    state = run.init(jax.random.key(0))
    start = jax.tree.map(np.asarray, state["params"])
    one = batch_of(run.config)
    batch = jax.tree.map(lambda a: a[None], one)
    history = []
    for _ in range(steps):
        state, metrics = run.train_step(state, batch)
        history.append({k: float(metrics[k]) for k in ("loss", "aux/indexer_kl")})
    return start, jax.tree.map(np.asarray, state["params"]), history


@pytest.mark.slow  # ten steps of a compiled DeepSeek model (10 s): the slow run's
def test_the_dense_warmup_trains_the_indexer_alone_and_its_kl_falls():
    start, end, history = train("dense_warmup", 12)
    for (path, before), after in zip(jax.tree_util.tree_flatten_with_path(start)[0], jax.tree.leaves(end)):
        if is_indexer(path):
            assert np.any(before != after), jax.tree_util.keystr(path)
        else:
            np.testing.assert_array_equal(before, after, err_msg=jax.tree_util.keystr(path))
    kl = [h["aux/indexer_kl"] for h in history]
    assert kl[-1] < 0.7 * kl[0], kl


@pytest.mark.slow  # ten steps of a compiled DeepSeek model (10 s): the slow run's
def test_the_sparse_stage_trains_the_model_and_the_indexer():
    start, end, history = train("sparse", 12)
    for (path, before), after in zip(jax.tree_util.tree_flatten_with_path(start)[0], jax.tree.leaves(end)):
        if "router_bias" not in jax.tree_util.keystr(path):
            assert np.any(before != after), jax.tree_util.keystr(path)
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["aux/indexer_kl"] < history[0]["aux/indexer_kl"]


@pytest.mark.parametrize("overrides, message", [
    (["indexer_training=dense_warmup", "opt_type=muon"], r"dense_warmup trains the indexer alone.*set opt_type=adamw"),
    (["indexer_training=sparse", "lora_rank=4"], r"lora_rank=4 freezes; set lora_rank=0 or indexer_training=none"),
    (["indexer_training=sparse", "index_n_heads=0"], r"indexer_training='sparse' does nothing without an indexer to train"),
], ids=["warmup-muon", "lora", "no-indexer"])
def test_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny(*overrides)


def _packed(config):
    """Two documents packed in the first row, padding at the end of the second."""
    batch = batch_of(config)
    seg = jnp.asarray([[1] * 7 + [2] * 9, [1] * 13 + [0] * 3])
    return {**batch, "segment_ids": seg, "loss_weights": (seg > 0).astype(jnp.float32),
            "positions": jnp.asarray([list(range(7)) + list(range(9)), list(range(16))])}


def _rank4_t_by_t(jaxpr, t: int) -> bool:
    """Whether a jaxpr (its loops' and checkpoints' bodies included) makes a float array [.., .., T, T]."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape, dtype = getattr(v.aval, "shape", ()), getattr(v.aval, "dtype", None)
            if len(shape) == 4 and shape[-2:] == (t, t) and jnp.issubdtype(dtype, jnp.floating):
                return True
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns") and _rank4_t_by_t(inner, t):
                return True
    return False


@pytest.mark.parametrize("overrides, block", [
    ([], None),
    pytest.param(["base_num_decoder_layers=4", "indexer_types=[full,shared,full,shared]",
                  "index_rope_interleave=true"], 4, marks=pytest.mark.slow),  # ~40 s of CPU: four layers, three kinds
    pytest.param(["attention=flash"], None, marks=pytest.mark.slow),  # the kernel, interpreted: the KL beside it
    pytest.param(["indexer_dtype=float8"], None, marks=pytest.mark.slow)],  # both forms choose on float8 scores
    ids=["v3.2", "glm5-shared-blocks-of-4", "kernel", "float8"])
def test_the_sparse_stage_over_the_selected_keys_gives_the_plain_forms_kl_and_gradients(monkeypatch, overrides,
                                                                                         block):
    """Beyond index_topk tokens the sparse stage takes the KL over each query's selected keys (selected.py's
    blocks): the plain form's indexer_kl and its gradients (the indexer's alone), with packed documents and padding,
    in blocks of 4 queries, with GLM-5's shared layers (no KL of their own, the full layer's keys) and beside the
    selected-key kernel (attention=flash, interpret mode); no [B, heads, T, T] array is made, where the plain form
    (the control) makes one."""
    config = tiny("indexer_training=sparse", "max_target_length=16", *overrides)
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    params = jax.jit(model.init_params)(jax.random.key(0))  # one compile, not op-by-op dispatch
    batch = _packed(config)
    if block:
        monkeypatch.setattr(selected, "QUERY_BLOCK", block)

    results = {}
    for form in (False, True):
        monkeypatch.setattr(indexer_training, "SELECTED_TRAINING", form)

        def kl(p):  # a new function per form: no trace cached from the other
            return model.loss_fn(p, batch, rt)[2]["indexer_kl"]

        jaxpr = jax.make_jaxpr(kl)(params).jaxpr
        results[form] = jax.jit(jax.value_and_grad(kl))(params), _rank4_t_by_t(jaxpr, 16)
    (want, want_grads), plain_t_by_t = results[False]
    (got, got_grads), selected_t_by_t = results[True]
    assert plain_t_by_t and not selected_t_by_t
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got_grads)[0], jax.tree.leaves(want_grads)):
        assert np.any(np.asarray(g)) == is_indexer(path), jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(w)) + 1e-30),
                                   err_msg=jax.tree_util.keystr(path))

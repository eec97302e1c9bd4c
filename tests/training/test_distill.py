"""Distillation: the loss and its gradient against the formula in numpy, tiled equal to untiled, and a
teacher read from a maxtrain checkpoint, sharded like the student on 8 devices and never trained."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import train
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.config import with_overrides
from maxtrain.models import distill
from maxtrain.parallel import sharding
from maxtrain.training import builder, distillation

TEACHER = ["base_emb_dim=48", "base_num_decoder_layers=3", "base_mlp_dim=96", "head_dim=12"]  # wider, deeper


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _numpy_loss(s, u, targets, w, alpha, temp):
    """(loss, kl sum, ce sum, d loss / d s) of the formula in models/distill.py, in float64 numpy."""
    s, u, w = (np.asarray(a, np.float64) for a in (s, u, w))
    log_p, log_q = _log_softmax(u / temp), _log_softmax(s / temp)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    log_s = _log_softmax(s)
    ce = -np.take_along_axis(log_s, np.asarray(targets)[..., None], -1)[..., 0]
    onehot = np.eye(s.shape[-1])[np.asarray(targets)]
    grad = w[..., None] * (alpha * temp * (np.exp(log_q) - np.exp(log_p)) + (1 - alpha) * (np.exp(log_s) - onehot))
    return alpha * temp ** 2 * (kl * w).sum() + (1 - alpha) * (ce * w).sum(), (kl * w).sum(), (ce * w).sum(), grad


@pytest.mark.parametrize("alpha, temp", [(0.5, 1.0), (0.3, 2.5), (1.0, 0.7), (0.0, 2.0)])
def test_loss_and_logit_gradient_match_the_formula(alpha, temp):
    rng = np.random.default_rng(0)
    s, u = (rng.normal(0, 2, (2, 5, 11)).astype(np.float32) for _ in range(2))
    targets = rng.integers(0, 11, (2, 5)).astype(np.int32)
    w = (rng.random((2, 5)) > 0.3).astype(np.float32)  # some targets weigh 0

    def loss(s, u):
        kl, ce = distill.terms(s, u, targets, w, temp)
        return distill.mix(kl, ce, alpha, temp), (kl, ce)

    (value, (kl, ce)), (ds, du) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(s, u)
    want, want_kl, want_ce, want_grad = _numpy_loss(s, u, targets, w, alpha, temp)
    np.testing.assert_allclose([value, kl, ce], [want, want_kl, want_ce], rtol=1e-5)
    np.testing.assert_allclose(ds, want_grad, rtol=1e-4, atol=1e-6)
    assert not np.any(du)  # the teacher's logits get no gradient


def _configs():
    student = config_lib.load_config([BASE_YML, *TINY])
    teacher = config_lib.load_config([BASE_YML, *with_overrides(TINY, *TEACHER)])
    return student, teacher


def _batch(config, rows=2):
    rng = np.random.default_rng(1)
    t = config.max_target_length
    tokens = rng.integers(0, config.vocab_size, (rows, t + 1)).astype(np.int32)
    seg = np.ones((rows, t), np.int32)
    seg[:, 20:] = 2  # two documents per row
    w = np.where(seg == 1, 1.0, 0.5).astype(np.float32)
    w[1, -5:] = 0.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "loss_weights": w,
            "positions": np.where(seg == 1, np.arange(t), np.arange(t) - 20).astype(np.int32)}


@pytest.mark.slow
def test_model_loss_matches_the_formula_tiled_or_not_and_the_teacher_gets_no_gradient():
    student, teacher = _configs()
    params, teacher_params = Model.bind(student).init_params(jax.random.key(0)), Model.bind(teacher).init_params(jax.random.key(1))
    batch = _batch(student)
    alpha, temp = 0.4, 2.0
    results = {}
    for tiles in (1, 4):
        rt = Runtime.from_config(student.replace(num_vocab_tiling=tiles), "cpu")
        assert rt.vocab_tiles == tiles

        def loss(p, t, rt=rt):
            value, _, _, kl, ce = distill.loss_fn(Model.bind(student), p, Model.bind(teacher), t, batch, rt, alpha, temp)
            return value, (kl, ce)

        results[tiles] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, teacher_params)
    (value, (kl, ce)), (grads, teacher_grads) = results[1]
    rt = Runtime.from_config(student, "cpu")

    @jax.jit
    def logits(p, t):  # the two models' whole logits, for the formula
        tokens = (batch["inputs"], batch["positions"], batch["segment_ids"])
        return Model.bind(student).forward(p, *tokens, rt)[0], Model.bind(teacher).forward(t, *tokens, rt)[0]

    s, u = logits(params, teacher_params)
    want, want_kl, want_ce, _ = _numpy_loss(s, u, batch["targets"], batch["loss_weights"], alpha, temp)
    np.testing.assert_allclose([value, kl, ce], [want, want_kl, want_ce], rtol=2e-5)
    assert all(not np.any(g) for g in jax.tree.leaves(teacher_grads))
    (tiled_value, tiled_parts), (tiled_grads, _) = results[4]
    np.testing.assert_allclose([tiled_value, *tiled_parts], [value, kl, ce], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(tiled_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A teacher trained 2 steps and checkpointed: wider and deeper than the tiny student."""
    out = tmp_path_factory.mktemp("teacher")
    train.main([BASE_YML, *with_overrides(TINY, *TEACHER), f"base_output_directory={out}", "run_name=teacher",
                "steps=2", "eval_interval=-1", "default_corpus_max_mb=0.3"])
    return str(out / "teacher")


@pytest.mark.slow
def test_teacher_from_a_checkpoint_is_sharded_like_the_student_and_frozen(teacher_run):
    config = builder.load_config([BASE_YML, *with_overrides(TINY, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
                                  "objective=distill", f"distill_teacher_path={teacher_run}"], log=lambda *_: None)
    assert distillation.teacher_config(config).base_emb_dim == 48
    run = builder.build(config, devices=jax.devices()[:8])
    state = run.init(jax.random.key(0))
    saved = checkpoint_files.read_params(teacher_run)
    for got, want in zip(jax.tree.leaves(state["teacher"]), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(got), want)
    for name in ("wq", "wo", "w_down"):
        spec = state["params"]["layers"]["decoder"][name].sharding.spec
        assert spec == state["teacher"]["layers"]["decoder"][name].sharding.spec and spec != P()
    teacher_shapes = {x.shape for x in jax.tree.leaves(state["teacher"])} - {x.shape for x in jax.tree.leaves(state["params"])}
    assert not any(x.shape in teacher_shapes for x in jax.tree.leaves(state["opt_state"]))  # no optimizer state
    before = jax.tree.map(np.asarray, state["teacher"])
    batch = {k: v[None] for k, v in _batch(config, rows=8).items()}
    with sharding.activation_sharding(run.mesh, config.logical_axis_rules):
        state, metrics = run.train_step(state, jax.device_put(batch, run.batch_sharding))
    assert np.isfinite(float(metrics["loss"])) and float(metrics["aux/distill_kl"]) > 0
    for got, want in zip(jax.tree.leaves(state["teacher"]), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), want)

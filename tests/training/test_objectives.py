"""Objectives: DPO's loss and gradients against a plain-jnp transcription of the formula; SFT weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import losses
from post_helpers import compose


def _config(*extra):
    return config_lib.load_config(compose(BASE_YML, *TINY, "dataset_type=jsonl", "grain_train_files=x.jsonl", "objective=dpo",
                                          "train_data_columns=[prompt,chosen,rejected]",
                                          "eval_data_columns=[prompt,chosen,rejected]", *extra))


def _sequences(rng, vocab):
    """Two pairs: (prompt, chosen completion, rejected completion) token tuples of different lengths."""
    pairs = []
    for lengths in ((3, 2, 4), (2, 3, 1)):
        p, c, r = (tuple(int(t) for t in rng.integers(4, vocab, size=n)) for n in lengths)
        pairs.append((p, c, r))
    return tuple(pairs)


def _packed_batch(pairs, length):
    """Both pairs in one row, as data/chat.py lays them out: segments 1, 2 (pair 1) and 3, 4 (pair 2);
    weights +1 on chosen completion targets, -1 on rejected ones."""
    tokens, seg, pos, w = [], [], [], []
    for k, (p, c, r) in enumerate(pairs):
        for part, (completion, sign) in enumerate(((c, 1.0), (r, -1.0))):
            seq = list(p + completion)
            tokens += seq
            seg += [2 * k + 1 + part] * len(seq)
            pos += list(range(len(seq)))
            w += [0.0] * len(p) + [sign] * len(completion)
    n = len(tokens)
    pad = length + 1 - n
    tokens, seg, pos, w = (np.asarray(x + [0] * pad) for x in (tokens, seg, pos, w))
    weights = w[1:] * ((seg[1:] == seg[:-1]) & (seg[:-1] != 0))
    return {"inputs": jnp.asarray(tokens[:-1][None], jnp.int32), "targets": jnp.asarray(tokens[1:][None], jnp.int32),
            "positions": jnp.asarray(pos[:-1][None], jnp.int32), "segment_ids": jnp.asarray(seg[:-1][None], jnp.int32),
            "loss_weights": jnp.asarray(weights[None], jnp.float32)}


def _plain_logp(params, prompt, completion, config, rt):
    """log p(completion | prompt), the sequence alone in its own row, from log_softmax."""
    seq = jnp.asarray([prompt + completion], jnp.int32)
    logits, _ = Model.bind(config).forward(params, seq[:, :-1], jnp.arange(seq.shape[1] - 1)[None], jnp.ones_like(seq[:, :-1]), rt)
    logp = jax.nn.log_softmax(logits, axis=-1)[0]
    return sum(logp[t - 1, seq[0, t]] for t in range(len(prompt), seq.shape[1]))


def _plain_dpo(params, reference, pairs, beta, eps, config, rt):
    """(sum over pairs of the DPO loss, (chosen rewards, rejected rewards))."""
    total, chosen, rejected = 0.0, [], []
    for p, c, r in pairs:
        chosen.append(beta * (_plain_logp(params, p, c, config, rt) - _plain_logp(reference, p, c, config, rt)))
        rejected.append(beta * (_plain_logp(params, p, r, config, rt) - _plain_logp(reference, p, r, config, rt)))
        x = chosen[-1] - rejected[-1]
        total += -(1 - eps) * jnp.log(jax.nn.sigmoid(x)) - eps * jnp.log(jax.nn.sigmoid(-x))
    return total, (jnp.stack(chosen), jnp.stack(rejected))


@pytest.mark.slow  # ~25 s idle, 90 s under this machine's load: 8 forward passes and their gradients compiled
def test_dpo_loss_and_gradients_match_the_formula():
    eps = 0.1
    config = _config("dpo_beta=0.5", f"dpo_label_smoothing={eps}")
    rt = Runtime.from_config(config, "cpu")
    params = Model.bind(config).init_params(jax.random.key(0))
    reference = Model.bind(config).init_params(jax.random.key(1))  # a different model, so the ratios are not 0
    pairs = _sequences(np.random.default_rng(0), config.vocab_size)
    batch = _packed_batch(pairs, config.max_target_length)

    def packed(p):
        loss, weight, metrics = losses.dpo(p, batch, reference, Model.bind(config), rt)
        return loss, (weight, metrics)

    (loss, (weight, metrics)), grads = jax.jit(jax.value_and_grad(packed, has_aux=True))(params)
    plain = jax.jit(jax.value_and_grad(_plain_dpo, has_aux=True), static_argnums=(2, 3, 4, 5, 6))
    (want, (chosen, rejected)), want_grads = plain(params, reference, pairs, 0.5, eps, config, rt)
    assert float(weight) == 2.0
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-6, err_msg=str(path))
    # The reference gets no gradient: the objective stops it.
    ref_grads = jax.jit(jax.grad(lambda r: losses.dpo(params, batch, r, Model.bind(config), rt)[0]))(reference)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(ref_grads))
    # Metrics: the implicit rewards of the two pairs.
    chosen, rejected = np.asarray(chosen), np.asarray(rejected)
    np.testing.assert_allclose(float(metrics["dpo_reward_accuracy"]), np.mean(chosen > rejected))
    np.testing.assert_allclose(float(metrics["dpo_reward_margin"]), np.mean(chosen - rejected), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["dpo_chosen_reward"]), np.mean(chosen), rtol=1e-4, atol=1e-6)


def test_dpo_against_itself_is_log_2_per_pair_and_ignores_padding_rows():
    config = _config()
    rt = Runtime.from_config(config, "cpu")
    params = Model.bind(config).init_params(jax.random.key(0))
    batch = _packed_batch(_sequences(np.random.default_rng(1), config.vocab_size), config.max_target_length)
    padded = {k: jnp.concatenate([v, jnp.zeros_like(v)]) for k, v in batch.items()}  # a second, empty row
    loss, weight, metrics = jax.jit(lambda p, b: losses.dpo(p, b, p, Model.bind(config), rt))(params, padded)
    assert float(weight) == 2.0
    np.testing.assert_allclose(float(loss), 2 * np.log(2.0), rtol=1e-6)
    assert float(metrics["dpo_reward_accuracy"]) == 0.0  # ties are not wins


def test_sft_is_the_lm_objective_on_the_weights_given():
    config = config_lib.load_config([BASE_YML, *TINY])
    rt = Runtime.from_config(config, "cpu")
    params = Model.bind(config).init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, config.vocab_size, size=(2, config.max_target_length + 1)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, size=(2, config.max_target_length)), jnp.float32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.broadcast_to(
        jnp.arange(config.max_target_length), (2, config.max_target_length)),
        "segment_ids": jnp.ones((2, config.max_target_length), jnp.int32), "loss_weights": weights}
    loss, weight, _ = losses.sft(params, batch, Model.bind(config), rt)
    logits, _ = Model.bind(config).forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], rt)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(float(loss), float(jnp.sum(nll * weights)), rtol=1e-5)
    assert float(weight) == float(weights.sum())

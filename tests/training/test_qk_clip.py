"""QK-clip (qk_clip_threshold, models/qk_clip.py; Kimi K2's MuonClip): each head's largest attention logit
against the dense reference, the scaling against its formula (a head past tau ends exactly at tau, the others
bitwise unchanged) for multi-head, grouped-query, biased and latent (MLA) attention, the train step reporting
and clipping with Muon when the logits are driven past the threshold, and the settings it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.config import load_config, with_overrides
from maxtrain.models import attention, qk_clip
from maxtrain.models.attention.max_logits import max_logits
from maxtrain.models.aux_names import MAX_ATTENTION_LOGIT, per_layer_name
from maxtrain.models.decoder import split_step_stats
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import builder


def packed_rows(batch: int, length: int, seed: int = 0):
    """segment_ids and positions [B, T]: row 0 two documents, row 1 one document then padding (segment 0)."""
    cut, pad = length // 3, length - length // 4
    seg = np.array([[1] * cut + [2] * (length - cut), [1] * pad + [0] * (length - pad)] * (batch // 2), np.int32)
    pos = np.array([list(range(cut)) + list(range(length - cut)), list(range(pad)) + list(range(length - pad))]
                   * (batch // 2), np.int32)
    return jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize("window, chunk, kv_heads", [(0, 0, 4), (0, 0, 2), (7, 0, 1), (0, 8, 2)],
                         ids=["mha", "gqa", "sliding-mqa", "chunked"])
def test_max_logits_is_the_dense_maximum(window, chunk, kv_heads):
    """Blocks of 16 queries by 16 keys over 48 tokens give the max of the dense [B, N, T, S] logits under the
    model's mask (documents, causality, the window or the chunks), padding queries left out."""
    b, t, n, h = 2, 48, 4, 8
    q = jax.random.normal(jax.random.key(0), (b, t, n, h)) * 3
    k = jax.random.normal(jax.random.key(1), (b, t, kv_heads, h))
    seg, pos = packed_rows(b, t)
    got = max_logits(q, k, seg, pos, scale=0.3, sliding_window=window, chunk=chunk, block=16)
    mask = attention.make_attention_mask(seg, seg, sliding_window=window, chunk=chunk, q_positions=pos,
                                         kv_positions=pos) & (seg > 0)[:, :, None]
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, n // kv_heads, axis=2)) * 0.3
    want = jnp.max(jnp.where(mask[:, None], logits, -jnp.inf), axis=(0, 2, 3))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the rule reads positions, not places: the same tokens in another order give the same maxima
    order = jax.random.permutation(jax.random.key(2), t)
    shuffled = max_logits(q[:, order], k[:, order], seg[:, order], pos[:, order], scale=0.3, sliding_window=window,
                          chunk=chunk, block=16)
    np.testing.assert_allclose(shuffled, want, rtol=1e-6)


MLA = ["model_name=deepseek3-tiny", "base_num_decoder_layers=2", "max_target_length=32", "vocab_size=512",
       "dtype=float32", "remat_policy=none", "per_device_batch_size=1", "enable_tensorboard=false",
       "max_new_tokens=0", "num_experts=4", "num_experts_per_tok=2", "n_routing_groups=1", "topk_routing_group=1"]
FAMILIES = {  # (settings, overrides) of each case; the first layer of the MLA cases is dense, the second a MoE
    "gqa": (TINY, []),
    "mha": (TINY, ["base_num_kv_heads=4"]),
    "biased": (TINY, ["decoder_block=qwen2"]),
    "mla": (MLA, []),
    "mla-no-q-rank": (MLA, ["q_lora_rank=0"]),
    # DeepSeek-V3.2: the maxima over the keys its indexer keeps (8 of up to 32)
    "mla-sparse": (MLA, ["index_n_heads=2", "index_head_dim=32", "index_topk=8"]),
}


def stats_of(model, params, batch, rt):
    _, _, aux = model.loss_fn(params, batch, rt)
    return split_step_stats(aux)[1]


def tiny_batch(config):
    seg, pos = packed_rows(2, config.max_target_length)
    tokens = jax.random.randint(jax.random.key(3), seg.shape, 0, config.vocab_size)
    return {"inputs": tokens, "targets": tokens, "positions": pos, "segment_ids": seg,
            "loss_weights": (seg > 0).astype(jnp.float32)}


BIG = ("wq", "wk", "wq_b", "wkv_b", "bq", "bk")  # the weights QK-clip scales


def blow_up(params, layer_types, layer: int, factor: float):
    """params with one layer's query and key weights (and biases) times factor."""
    kind = layer_types[layer].kind
    index = sum(lt.kind == kind for lt in layer_types[:layer])
    stack = {n: (w.at[index].multiply(factor) if n in BIG else w) for n, w in params["layers"][kind].items()}
    return {**params, "layers": {**params["layers"], kind: stack}}


# The latent-attention cases compile a DeepSeek model each (10 to 20 s): the slow run's (pyproject.toml's marker)
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f.startswith("mla") else f
                                    for f in sorted(FAMILIES)])
@pytest.mark.parametrize("layer", [0, 1])
def test_clip_brings_each_head_past_tau_to_tau(family, layer):
    """One layer's query and key weights blown up and tau set at the median of its heads' maxima (every other
    layer's below it): after clip, that layer's heads that were past tau have their largest logit at tau (1e-5),
    its other heads theirs as before (1e-6), the layers before it are bitwise as they were, and so is every weight
    but the query and key projections."""
    settings, overrides = FAMILIES[family]
    config = load_config(with_overrides([BASE_YML, *settings], *overrides, "qk_clip_threshold=1"))
    model = Model.bind(config)
    rt = Runtime.from_config(config, "cpu")
    params = blow_up(model.init_params(jax.random.key(0)), model.layer_types, layer, 6.0)
    batch = tiny_batch(config)
    before = stats_of(model, params, batch, rt)
    names = [per_layer_name(MAX_ATTENTION_LOGIT, i, len(model.layer_types)) for i in range(len(model.layer_types))]
    assert sorted(n for n in before if "attention_logit" in n) == sorted(names)
    tau = float(np.median(np.asarray(before[names[layer]])))
    assert all(float(np.max(before[n])) < tau for i, n in enumerate(names) if i != layer)
    config = load_config(with_overrides([BASE_YML, *settings], *overrides, f"qk_clip_threshold={tau}"))
    clipped = qk_clip.clip(params, before, config, model.layer_types)
    after = stats_of(model, clipped, batch, rt)
    old, new = np.asarray(before[names[layer]]), np.asarray(after[names[layer]])
    past = old > tau
    assert past.any()
    np.testing.assert_allclose(new[past], tau, rtol=1e-5)
    # a query head that shares its key head with a clipped one takes the key's factor back: equal to rounding
    np.testing.assert_allclose(new[~past], old[~past], rtol=1e-6)
    for name in names[:layer]:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    for kind, p in params["layers"].items():
        for n, w in p.items():
            if n not in BIG:
                assert clipped["layers"][kind][n] is w, f"{kind}/{n}"
    for name in params:
        if name != "layers":
            assert clipped[name] is params[name], name


def test_train_step_reports_and_clips_with_muon():
    """opt_type=muon, two micro-batches, the last layer's query and key weights blown up so that its logits pass
    tau: the step reports each layer's largest logit (the max over both micro-batches), and at learning rate 0 (the
    update is QK-clip alone) the next step on the same batch reports the last layer at tau and the first as before."""
    overrides = ["opt_type=muon", "learning_rate=0", "gradient_accumulation_steps=2", "qk_clip_threshold=10",
                 "dataset_type=synthetic"]
    run = builder.build(load_config(with_overrides([BASE_YML, *TINY], *overrides)), devices=jax.devices()[:1])
    state = run.init(jax.random.key(0))
    state["params"] = blow_up(state["params"], run.model.layer_types, 1, 8.0)
    one = tiny_batch(run.config)
    second = {k: v[::-1] for k, v in one.items()}  # the second micro-batch: the rows swapped
    batch = {k: jnp.stack([one[k][:1], second[k][:1]]) for k in one}
    names = [f"aux/max_attention_logit/layer_{i}" for i in range(2)]
    expected = [max(float(np.max(np.asarray(stats_of(run.model, state["params"], {k: v[m] for k, v in batch.items()},
                                                    run.rt)[per_layer_name(MAX_ATTENTION_LOGIT, i, 2)])))
                    for m in range(2)) for i in range(2)]
    state, metrics = run.train_step(state, batch)
    first = [float(metrics[n]) for n in names]
    np.testing.assert_allclose(first, expected, rtol=1e-5)
    assert first[0] < 10 < first[1]
    state, metrics = run.train_step(state, batch)
    assert float(metrics[names[0]]) == first[0]
    np.testing.assert_allclose(float(metrics[names[1]]), 10, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["decoder_block=qwen3"], r"qk_clip_threshold=100.0: qwen3 normalises queries and keys .* set qk_clip_threshold=0"),
    (["lora_rank=4"], r"lora_rank=4 freezes; set qk_clip_threshold=0 or lora_rank=0"),
    (["ici_pipeline_parallelism=2"], r"pipeline stages .* ici_pipeline_parallelism=1"),
], ids=["qk-norm", "lora", "pipeline"])
def test_refused_where_it_cannot_clip(overrides, message):
    config = load_config(with_overrides([BASE_YML, *TINY], "qk_clip_threshold=100", *overrides))
    with pytest.raises(ValueError, match=message):
        qk_clip.check(config, Model.bind(config))

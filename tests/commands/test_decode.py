"""Decoding: the KV cache agrees with the full forward pass, sampling is seeded and samples the right sets.

Tolerances: cached and full-forward logits agree to 1e-4 absolute (float32; measured ~1e-6).
Sampling frequencies are checked against the renormalized probabilities within 5 standard errors
of a binomial proportion over 20,000 draws.
"""

from __future__ import annotations

import data_helpers as h
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain import decode
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.checkpointing import manager as checkpoint_manager
from maxtrain.config import with_overrides
from maxtrain.data import DataError, pipeline
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.models import sampling
from maxtrain.parallel import sharding
from maxtrain.training import builder, optimizer, precision

TINY = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=1"]

forward = jax.jit(lambda p, t, pos, seg, config, rt: Model.bind(config).forward(p, t, pos, seg, rt)[0],
                  static_argnums=(4, 5))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    config = config_lib.load_config(["configs/base.yml", *TINY, f"base_output_directory={out}", "run_name=r"])
    rt = Runtime.from_config(config)
    params = jax.jit(Model.bind(config).init_params)(jax.random.key(1))
    # Sharper logits than at initialization, so that greedy choices are far from ties.
    params["output"] = params["output"] * 8.0
    return config, rt, params


def test_greedy_with_cache_equals_argmax_of_full_forward_at_every_position(tiny):
    config, rt, params = tiny
    prompt = [1, 17, 99, 250, 3]
    new = sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=20)
    assert len(new) == 20
    tokens = jnp.asarray([prompt + new], jnp.int32)
    positions = jnp.arange(tokens.shape[1])[None]
    logits = forward(params, tokens, positions, jnp.ones_like(tokens), config, rt)[0]
    # The token chosen after position t is the argmax of the full forward pass' logits at t.
    full_argmax = np.asarray(jnp.argmax(logits[len(prompt) - 1:-1], axis=-1)).tolist()
    assert new == full_argmax
    top2 = np.sort(np.asarray(logits[len(prompt) - 1:-1]), axis=-1)[:, -2:]
    assert np.min(top2[:, 1] - top2[:, 0]) > 1e-3  # every choice is far from a tie, so the check is decisive
    assert len(set(new)) > 3  # not one token repeated


def test_cached_logits_match_full_forward(tiny):
    config, rt, params = tiny
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 4, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(24), tokens.shape)
    full = forward(params, tokens, positions, jnp.ones_like(tokens), config, rt)
    step = jax.jit(lambda p, t, pos, c, i: Model.bind(config).forward_with_cache(p, t, pos, c, i, rt))
    cache = Model.bind(config).init_cache(2, 24, rt.dtype)
    pieces, index = [], 0
    for length in (8, 1, 1, 1, 13):  # a prefill, single tokens, then a chunk
        logits, cache = step(params, tokens[:, index:index + length], positions[:, index:index + length], cache, index)
        pieces.append(logits)
        index += length
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)


def test_cached_logits_match_full_forward_with_post_norms_qk_norm_over_heads_and_windows():
    """OLMo 3's layers decode from the cache as the full forward computes: qk-norm over all heads' features
    of each new token, a 4-token window in three layers of four, another RoPE theta on the sliding layers."""
    config = config_lib.load_config(with_overrides(["configs/base.yml", *TINY], "decoder_block=olmo3",
                                                   "base_num_decoder_layers=4", "sliding_window_size=4",
                                                   "local_rope_max_timescale=100.0"))
    rt = Runtime.from_config(config)
    params = jax.jit(Model.bind(config).init_params)(jax.random.key(1))
    params["layers"]["decoder"]["q_norm"] = 1.0 + jax.random.normal(jax.random.key(3), params["layers"]["decoder"][
        "q_norm"].shape)  # per-feature scales, so that normalizing over the wrong features would show
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 4, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(9), tokens.shape)
    full = forward(params, tokens, positions, jnp.ones_like(tokens), config, rt)
    step = jax.jit(lambda p, t, pos, c, i: Model.bind(config).forward_with_cache(p, t, pos, c, i, rt))
    cache, pieces = Model.bind(config).init_cache(2, 9, rt.dtype), []
    for index, length in ((0, 7), (7, 1), (8, 1)):  # a prefill longer than the window, then single tokens
        logits, cache = step(params, tokens[:, index:index + length], positions[:, index:index + length], cache, index)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)


def test_seeded_sampling_is_deterministic(tiny):
    config, rt, params = tiny
    settings = {"temperature": 0.8, "top_k": 100, "top_p": 0.95}  # every sampling stage on
    prompt = [1, 5, 6, 7]
    a = sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=16, seed=3, **settings)
    b = sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=16, seed=3, **settings)
    c = sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=16, seed=4, **settings)
    assert a == b
    assert a != c


def test_sampling_settings_follow_the_strategy(tiny):
    config = tiny[0].replace(decode_sampling_temperature=0.7, decode_sampling_top_k=5, decode_sampling_nucleus_p=0.8)
    assert sampling.sampling_settings(config)["temperature"] == 0.0  # greedy is the default
    assert sampling.sampling_settings(config.replace(decode_sampling_strategy="weighted")) == \
        {"temperature": 0.7, "top_k": 0, "top_p": 1.0}
    assert sampling.sampling_settings(config.replace(decode_sampling_strategy="topk")) == \
        {"temperature": 0.7, "top_k": 5, "top_p": 1.0}
    assert sampling.sampling_settings(config.replace(decode_sampling_strategy="nucleus")) == \
        {"temperature": 0.7, "top_k": 0, "top_p": 0.8}
    with pytest.raises(config_lib.ConfigError, match="decode_sampling_strategy"):
        config_lib.load_config(["configs/base.yml", "decode_sampling_strategy=beam"])


PROBS = np.asarray([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])


def sample_frequencies(draws=20_000, **settings) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (draws, len(PROBS)))
    tokens = sampling.sample_token(logits, jax.random.key(0), **settings)
    return np.bincount(np.asarray(tokens), minlength=len(PROBS)) / draws


def assert_frequencies(freq, expected, draws=20_000):
    stderr = np.sqrt(expected * (1 - expected) / draws)
    assert np.all(np.abs(freq - expected) <= 5 * stderr + 1e-12), (freq, expected)


@pytest.mark.parametrize("settings,expected", [
    ({"temperature": 1.0, "top_k": 3, "top_p": 1.0}, np.r_[PROBS[:3], np.zeros(5)]),        # top 3 only
    ({"temperature": 1.0, "top_k": 0, "top_p": 0.6}, np.r_[PROBS[:2], np.zeros(6)]),        # 0.4 + 0.25 >= 0.6
    ({"temperature": 1.0, "top_k": 0, "top_p": 0.7}, np.r_[PROBS[:3], np.zeros(5)]),        # 0.65 < 0.7 <= 0.8
    ({"temperature": 1.0, "top_k": 0, "top_p": 1.0}, PROBS),                                # plain sampling
    ({"temperature": 0.5, "top_k": 0, "top_p": 1.0}, PROBS**2),                             # p^(1/T)
    ({"temperature": 1.0, "top_k": 4, "top_p": 0.5}, np.r_[PROBS[:2], np.zeros(6)]),        # both: top-k, then top-p
])
def test_top_k_top_p_and_temperature_sample_the_right_distribution(settings, expected):
    expected = expected / expected.sum()
    freq = sample_frequencies(**settings)
    assert np.all(freq[expected == 0] == 0)  # never a token outside the kept set
    assert_frequencies(freq, expected)


def test_greedy_is_argmax():
    logits = jnp.asarray([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sampling.sample_token(logits, jax.random.key(0), temperature=0.0, top_k=0, top_p=1.0).tolist() == [1, 0]


@pytest.fixture(scope="module")
def step_dir(tiny):
    """A checkpoint written by the trainer's Checkpointer (state, data iterator, metadata) at step 7."""
    config, rt, params = tiny
    config = config_lib.with_devices(config, 1)
    # train_step.init_state's layout, around the fixture's params.
    state = {"step": jnp.asarray(7, jnp.int32), "params": params,
             "opt_state": optimizer.make_optimizer(config, Model.bind(config)).init(params),
             "loss_scale": precision.init_loss_scale(config, rt.dtype), "rng": jax.random.key_data(jax.random.key(0))}
    ckpt = checkpoint_manager.Checkpointer(config.replace(async_checkpointing=False))
    ckpt.save(7, state, pipeline.synthetic_iterator(config, 0), {"config": {}})
    ckpt.close()
    return f"{config.checkpoint_dir}/7"


def test_decode_cli_loads_params_from_a_training_checkpoint(tiny, step_dir, capsys):
    """python -m maxtrain.decode configs/base.yml ... load_parameters_path=<run>/checkpoints/<step>"""
    config, rt, params = tiny
    argv = ["configs/base.yml", *TINY, f"base_output_directory={config.base_output_directory}",
            f"load_parameters_path={step_dir}", "prompt=def ", "max_new_tokens=12"]
    text = decode.main(argv)
    printed = capsys.readouterr().out
    assert "greedy" in printed and text in printed and text.startswith("def ")

    # The same continuation as greedy decoding of the in-memory params (20 tokens: compiled already).
    tokenizer = data_lib.tokenizer_for(config)
    expected = sampling.generate(params, [tokenizer.bos_id] + tokenizer.encode("def "), Model.bind(config), rt, max_new_tokens=20)
    expected = expected[:12]
    expected = expected[:expected.index(tokenizer.eos_id)] if tokenizer.eos_id in expected else expected
    assert text == "def " + tokenizer.decode(expected)

    # A run's checkpoints directory means its latest step.
    assert decode.main([*argv[:-3], f"load_parameters_path={config.checkpoint_dir}", "prompt=def ",
                        "max_new_tokens=12"]) == text
    with pytest.raises(checkpoint_files.CheckpointError, match="does not fit the configured model"):
        decode.main(with_overrides(argv, "base_mlp_dim=128"))
    with pytest.raises(checkpoint_files.CheckpointError, match="does not exist"):
        decode.main(with_overrides(argv, f"load_parameters_path={config.checkpoint_dir}/8"))
    with pytest.raises(config_lib.ConfigError, match="load_parameters_path"):
        decode.main(argv[:-3])
    # the continuation, as the prompt, within max_target_length: refused before the model is read
    length = config.max_target_length
    with pytest.raises(config_lib.ConfigError, match=rf"the prompt is (\d+) tokens and max_new_tokens={length}: \d+ "
                                                     rf"tokens, more than max_target_length={length} .* set "
                                                     r"max_new_tokens=\d+ or less"):
        decode.main(with_overrides(argv, f"max_new_tokens={length}"))


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_decode_with_a_tokenizer_smaller_than_the_model_vocabulary(tiny, step_dir, kind, tmp_path_factory,
                                                                    monkeypatch):
    """The model (512 ids) emits ids the 320-piece tokenizer lacks: they decode to nothing, never an error."""
    config = tiny[0]
    path = h.tokenizer_path(tmp_path_factory, kind=kind)
    tok = tokenizer_lib.load(path)
    generated, generate = [], sampling.generate
    monkeypatch.setattr(sampling, "generate", lambda *a, **k: generated.append(generate(*a, **k)) or generated[-1])
    argv = ["configs/base.yml", *TINY, f"base_output_directory={config.base_output_directory}",
            f"load_parameters_path={step_dir}", f"tokenizer_path={path}", "prompt=alpha beta", "max_new_tokens=16"]
    text = decode.main(argv)
    assert any(t >= tok.vocab_size for t in generated[0])  # the case this test is about happens
    assert text == "alpha beta" + tok.decode([t for t in generated[0] if t < tok.vocab_size])
    # More pieces than the model has ids: refused before the checkpoint is read (it would not fit either).
    with pytest.raises(DataError, match=rf"the tokenizer {path} has 320 pieces but vocab_size=300: .*"
                                        "Set vocab_size=320 or more"):
        decode.main(with_overrides(argv, "vocab_size=300"))


def test_generate_stops_at_any_of_several_eos_ids(tiny):
    config, rt, params = tiny
    prompt = [1, 17, 99, 250, 3]  # the shapes of the first test: compiled already
    new = sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=20)
    first, second = new[4], new[7]
    assert sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=20, eos_id=(second, first)) == \
        new[:new.index(first)]
    assert sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=20, eos_id=second) == new[:new.index(second)]


def test_load_params_places_arrays_on_the_mesh(tiny, step_dir):
    """Only the params are read, each with the sharding it is given (FSDP over every device)."""
    config = config_lib.with_devices(tiny[0], jax.device_count())
    mesh = sharding.create_mesh(config)
    restored = checkpoint_files.load_params(step_dir, builder.abstract_params(Model.bind(config), mesh))
    assert sorted(restored) == sorted(tiny[2])
    assert restored["token_embedding"].sharding.mesh.shape == mesh.shape
    np.testing.assert_array_equal(np.asarray(restored["output"]), np.asarray(tiny[2]["output"]))


def test_no_new_tokens_is_an_empty_result_not_an_index_error(tiny):
    """max_new_tokens=0 traced a loop body that indexes an empty array (a raw IndexError in maxtrain.decode)."""
    config, rt, params = tiny
    assert sampling.generate(params, [1, 17], Model.bind(config), rt, max_new_tokens=0) == []
    assert sampling.generate_tokens(params, jnp.asarray([[1, 17]], jnp.int32), jax.random.key(0), model=Model.bind(config),
                                    rt=rt, max_new_tokens=0, temperature=0.0, top_k=0, top_p=1.0).shape == (1, 0)


class _Tokenizer:
    """What checked_prompt_ids reads: encode (white space dropped, as some sentencepiece models do), bos_id, path."""

    def __init__(self, bos_id):
        self.bos_id, self.path = bos_id, "tok.model"

    def encode(self, text):
        return [ord(c) for c in text if not c.isspace()]


@pytest.mark.parametrize("bos_id", [None, 1])
def test_a_prompt_without_tokens_of_its_own_is_refused_naming_its_key_whatever_the_bos(bos_id):
    tok = _Tokenizer(bos_id)
    with pytest.raises(config_lib.ConfigError, match=r"^prompt='' is empty: .* give a prompt with some text"):
        tokenizer_lib.checked_prompt_ids(tok, "")
    with pytest.raises(config_lib.ConfigError, match=r"^prompt=' \\n' gives no tokens with the tokenizer tok.model"):
        tokenizer_lib.checked_prompt_ids(tok, " \n")  # a BOS alone is no prompt
    assert tokenizer_lib.checked_prompt_ids(tok, "ab") == ([] if bos_id is None else [1]) + [97, 98]
    with pytest.raises(config_lib.ConfigError, match=r"prompt='abcd' is \d tokens, more than max_target_length=3"):
        tokenizer_lib.checked_prompt_ids(tok, "abcd", max_length=3)

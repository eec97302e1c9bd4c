"""Qwen3-Next's hybrid stack (models/families/qwen3_next/, models/recurrent/gated_deltanet.py) beyond its parity with
transformers (tests/models/test_families.py): packed documents give what the documents give apart, the mixed stack
scans as it runs unrolled, a tiny model learns, decoding from the cache (the delta rule's state and the convolution's
window beside attention's k and v) computes the full forward's logits, bad shapes are refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import load_config, with_overrides
from maxtrain.models import sampling

# Two cycles of (gated delta-net, full attention), experts with a gated shared expert, 2 key heads for 4 value heads.
HYBRID = ["decoder_block=qwen3_next", "base_num_decoder_layers=4", "inhomogeneous_layer_cycle_interval=2",
          "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "shared_experts=1",
          "gdn_num_key_heads=2", "gdn_num_value_heads=4", "gdn_key_head_dim=8", "gdn_value_head_dim=8",
          "gdn_chunk_size=8", "partial_rotary_factor=0.5", "max_new_tokens=0"]


def setup(*overrides):
    cfg = load_config([BASE_YML, *with_overrides(with_overrides(TINY, *HYBRID), *overrides)])
    rt = Runtime.from_config(cfg)
    return cfg, rt, Model.bind(cfg).init_params(jax.random.key(0))


def forward(cfg, rt, params, tokens, segment_ids):
    positions = np.concatenate([np.arange(n) for n in np.unique(segment_ids[0], return_counts=True)[1]])[None]
    return Model.bind(cfg).forward(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids), rt)[0]


@pytest.mark.slow  # ~15 s on 2 cores (2026-11-29): over the default run's share
def test_a_packed_row_is_its_documents_apart():
    """The convolution and the delta rule's state restart at each document, as attention's mask does."""
    cfg, rt, params = setup()
    tokens = np.random.default_rng(0).integers(4, cfg.vocab_size, (1, 32))
    segments = np.array([[1] * 11 + [2] * 13 + [3] * 8])
    packed = forward(cfg, rt, params, tokens, segments)
    start = 0
    for n in (11, 13, 8):
        alone = forward(cfg, rt, params, tokens[:, start:start + n], np.ones((1, n), np.int32))
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=2e-5)
        start += n


@pytest.mark.slow
def test_the_mixed_stack_scans_as_it_runs_unrolled():
    cfg, rt, params = setup("remat_policy=full")
    tokens = np.random.default_rng(1).integers(4, cfg.vocab_size, (2, 16))
    segments = np.ones((2, 16), np.int32)
    scanned = forward(cfg, rt, params, tokens, segments)
    unrolled = forward(cfg.replace(scan_layers=False), Runtime.from_config(cfg.replace(scan_layers=False)),
                       params, tokens, segments)
    np.testing.assert_allclose(scanned, unrolled, atol=2e-5)
    assert [t.kind for t in Model.bind(cfg).layer_types] == ["linear_moe", "full_moe"] * 2


def decode_setup(*overrides):
    cfg, rt, params = setup(*overrides)
    tokens = jnp.asarray(np.random.default_rng(2).integers(4, cfg.vocab_size, (2, 30)))
    full = forward(cfg, rt, params, np.asarray(tokens), np.ones((2, 30), np.int32))
    step = jax.jit(lambda p, t, pos, c, i, first: Model.bind(cfg).forward_with_cache(p, t, pos, c, i, rt, first))
    return cfg, rt, params, tokens, full, step


def test_decoding_from_the_cache_computes_the_full_forward():
    """A prefill over two chunks, a single token (the recurrent step), a chunk again from the carried state, a token:
    the logits are the full forward's; the gated delta-net's cache is a fixed size whatever the length."""
    cfg, rt, params, tokens, full, step = decode_setup("base_num_decoder_layers=2")  # one layer of each kind
    cache = Model.bind(cfg).init_cache(2, 30, rt.dtype)
    assert {k: v.shape for k, v in cache.items()} == {"state": (1, 2, 4, 8, 8), "conv": (1, 2, 3, 64),
                                                      "k": (1, 2, 30, 2, 16), "v": (1, 2, 30, 2, 16)}
    pieces, index = [], 0
    for length in (14, 1, 14, 1):  # two shapes to compile
        positions = jnp.broadcast_to(jnp.arange(index, index + length), (2, length))
        logits, cache = step(params, tokens[:, index:index + length], positions, cache, index, None)
        pieces.append(logits)
        index += length
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_left_padded_rows_and_greedy_decoding_give_the_full_forwards_choices():
    """A left-padded row (garbage in its padding) gives its unpadded logits: the padding neither writes the state
    nor enters the window; greedy decoding picks the full forward's argmax at every step."""
    cfg, rt, params, tokens, full, step = decode_setup()
    first = jnp.asarray([0, 5])  # row 1: 5 slots of padding, then tokens[1, :25]
    padded = tokens.at[1, 5:].set(tokens[1, :25])
    cache, pieces = Model.bind(cfg).init_cache(2, 30, rt.dtype), []
    for index, length in ((0, 13), (13, 1), (14, 16)):
        slots = jnp.arange(index, index + length)[None, :]
        logits, cache = step(params, padded[:, index:index + length], jnp.maximum(slots - first[:, None], 0), cache,
                             index, first)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1)[1, 5:], full[1, :25], atol=1e-4, rtol=0)

    prompt = [int(t) for t in tokens[0, :6]]
    new = sampling.generate(params, prompt, Model.bind(cfg), rt, max_new_tokens=8)
    logits = forward(cfg, rt, params, np.asarray([prompt + new]), np.ones((1, 14), np.int32))[0]
    assert new == np.asarray(jnp.argmax(logits[5:-1], axis=-1)).tolist()


@pytest.mark.parametrize("overrides, fragment", [
    (["gdn_num_value_heads=3"], "gdn_num_value_heads=3 must be a multiple of gdn_num_key_heads=2"),
    (["gdn_conv_kernel_dim=0"], "gdn_conv_kernel_dim=0 is not allowed"),
    (["inhomogeneous_layer_cycle_interval=5"], "inhomogeneous_layer_cycle_interval=5 leaves no full-attention layer"),
    (["partial_rotary_factor=0.05"], "partial_rotary_factor=0.05 rotates 0 of head_dim=16 features"),
    (["ici_context_parallelism=2", "context_parallel_reorder_strategy=striped"],
     "context_parallel_reorder_strategy=striped deals the tokens round-robin"),
    (["ici_context_parallelism=4"], "cuts max_target_length=32 into 8 chunks of 4 tokens, but the gated delta-net "
                                    "needs chunks of at least 8"),
    (["ici_pipeline_parallelism=2"], "gated delta-net layers do not run with stage parallelism 2 yet"),
])
def test_impossible_settings_are_refused(overrides, fragment):
    with pytest.raises(config_lib.ConfigError, match=fragment):
        load_config([BASE_YML, *with_overrides(with_overrides(TINY, *HYBRID), *overrides)])


def test_gated_deltanet_settings_need_the_family():
    with pytest.raises(config_lib.ConfigError, match="gdn_num_key_heads=4 does nothing without decoder_block=qwen3_next"):
        load_config([BASE_YML, *TINY, "gdn_num_key_heads=4"])


@pytest.mark.slow
def test_a_tiny_hybrid_learns_the_default_corpus(tmp_path):
    """The user's command on the default corpus: the loss falls, and the run ends with a greedy sample."""
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    hybrid = [o for o in HYBRID if not o.startswith("max_new_tokens")]
    metrics_file = tmp_path / "m.jsonl"
    args = [BASE_YML, *with_overrides(with_overrides(TINY, *hybrid), "max_new_tokens=48", "steps=40",
                                      "learning_rate=0.01", "warmup_steps_fraction=0.1", "eval_interval=-1"),
            f"base_output_directory={tmp_path}", "run_name=hybrid", f"metrics_file={metrics_file}"]
    result = train.main(args)
    losses = [json.loads(line)["learning/loss"] for line in metrics_file.read_text().splitlines()
              if "learning/loss" in line]
    assert len(losses) == 40 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    assert isinstance(result.sample, str)

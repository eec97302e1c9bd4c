import jax
import jax.numpy as jnp
import pytest

from conftest import BASE_YML
from maxtrain.models.model import Model
from maxtrain.training import optimizer
from maxtrain.config import load_config, with_overrides


def cfg(*overrides):
    return load_config(with_overrides([BASE_YML, "steps=100", "learning_rate=1.0", "warmup_steps_fraction=0.1"],
                                      *overrides))


def test_cosine_schedule():
    lr = optimizer.make_schedule(cfg("lr_schedule_type=cosine", "cosine_learning_rate_final_fraction=0.1"))
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(55)) == pytest.approx(0.55, abs=1e-6)  # halfway through the decay: (1 + 0.1) / 2
    assert float(lr(100)) == pytest.approx(0.1)
    assert float(lr(500)) == pytest.approx(0.1)


def test_wsd_schedule():
    lr = optimizer.make_schedule(cfg("lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.2"))
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(79)) == pytest.approx(1.0)
    assert float(lr(90)) == pytest.approx(0.5)
    assert float(lr(100)) == pytest.approx(0.0)


def test_constant_schedule():
    lr = optimizer.make_schedule(cfg("lr_schedule_type=constant"))
    assert float(lr(5)) == pytest.approx(0.5) and float(lr(90)) == pytest.approx(1.0)


def test_weight_decay_skips_norms_only_by_default():
    c = cfg("base_num_decoder_layers=1", "base_emb_dim=8", "head_dim=4", "base_mlp_dim=8", "vocab_size=16")
    params = jax.jit(Model.bind(c).init_params)(jax.random.key(0))
    mask = optimizer.weight_decay_mask(params, c)
    assert mask["layers"]["decoder"]["wq"] and mask["token_embedding"] and mask["output"]
    assert not mask["layers"]["decoder"]["attn_norm"] and not mask["final_norm"]
    mask = optimizer.weight_decay_mask(params, c.replace(weight_decay_exclude_embeddings=True))
    assert not mask["token_embedding"]


def test_decay_is_applied_to_masked_params_only():
    c = cfg("base_num_decoder_layers=1", "base_emb_dim=8", "head_dim=4", "base_mlp_dim=8", "vocab_size=16",
            "adam_weight_decay=0.5", "lr_schedule_type=constant", "warmup_steps_fraction=0")
    params = jax.jit(Model.bind(c).init_params)(jax.random.key(0))
    tx = optimizer.make_optimizer(c, Model.bind(c))
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zero_grads, tx.init(params), params)
    assert float(jnp.abs(updates["final_norm"]).max()) == 0.0
    assert jnp.allclose(updates["layers"]["decoder"]["wq"], -0.5 * params["layers"]["decoder"]["wq"])


def test_a_fixed_tensor_takes_no_weight_decay_and_stays_as_loaded():
    """Gemma 4's layer scalars are transformers' buffers (ParamSpec.fixed): no gradient reaches them and the
    optimizer leaves them as loaded, where weight decay would shrink them every step."""
    c = cfg("decoder_block=gemma4_text", "base_num_decoder_layers=2", "base_emb_dim=8", "base_num_query_heads=2",
            "base_num_kv_heads=1", "head_dim=4", "global_head_dim=4", "base_mlp_dim=8", "vocab_size=16",
            "attention_layer_types=[sliding,full]", "sliding_window_size=4", "adam_weight_decay=0.5", "lr_schedule_type=constant",
            "warmup_steps_fraction=0")
    model = Model.bind(c)
    params = jax.jit(model.init_params)(jax.random.key(0))
    tx = optimizer.make_optimizer(c, model)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zero_grads, tx.init(params), params)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(updates)[0]}
    scalars = [k for k in flat if k.endswith("['layer_scalar']")]
    assert scalars and all(float(jnp.abs(flat[k]).max()) == 0.0 for k in scalars)
    assert any(k.endswith("['wq']") and float(jnp.abs(flat[k]).max()) > 0.0 for k in flat)  # decayed: the control

"""Muon (opt_type=muon, training/muon.py): its update against a numpy Newton-Schulz for each layer's and
each expert's matrix, which parameters it trains, FSDP x TP against one device, a checkpoint round trip,
and the inputs it refuses."""

import jax
import numpy as np
import optax
import pytest

from ckpt_helpers import assert_bitwise_equal, cache_dir, train  # noqa: F401  (cache_dir is a fixture)
from conftest import BASE_YML, TINY
from maxtrain.models.model import Model
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.config import ConfigError, load_config, with_overrides
from maxtrain.training import builder, muon, optimizer
from optax.contrib import MuonDimensionNumbers

MOE = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24"]
LR, WD = 0.01, 0.5
MUON_MATRICES = ["w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]


def newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Keller Jordan's quintic iteration on one matrix, in float64: about U V^T of g = U S V^T."""
    x = np.asarray(g, np.float64)
    wide = x if x.shape[0] <= x.shape[1] else x.T
    wide = wide / np.linalg.norm(wide)
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(steps):
        s = wide @ wide.T
        wide = a * wide + (b * s + c * s @ s) @ wide
    return wide if x.shape[0] <= x.shape[1] else wide.T


def matrices(name: str, x: np.ndarray) -> list[np.ndarray]:
    """The [fan_in, fan_out] matrices of a stacked parameter, written out by hand for each layout."""
    layers = range(x.shape[0])
    if name in ("wq", "wk", "wv"):       # [L, D, N, H]: D -> N*H
        return [x[i].reshape(x.shape[1], -1) for i in layers]
    if name == "wo":                      # [L, N, H, D]: N*H -> D
        return [x[i].reshape(-1, x.shape[-1]) for i in layers]
    if x.ndim == 4:                       # experts [L, E, in, out]
        return [x[i, e] for i in layers for e in range(x.shape[1])]
    return [x[i] for i in layers]         # dense MLP [L, in, out]


def first_update(*overrides):
    config = load_config(with_overrides([BASE_YML, *TINY], "lr_schedule_type=constant", "warmup_steps_fraction=0",
                                        f"learning_rate={LR}", "gradient_clipping_threshold=0", *overrides))
    params = jax.jit(Model.bind(config).init_params)(jax.random.key(0))
    leaves, treedef = jax.tree.flatten(params)
    grads = treedef.unflatten([jax.random.normal(jax.random.key(i + 1), x.shape, x.dtype) for i, x in enumerate(leaves)])
    tx = optimizer.make_optimizer(config, Model.bind(config))
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    return jax.tree.map(np.asarray, (params, grads, updates))


@pytest.mark.parametrize("family, rms", [([], 0.2), (MOE, -1)], ids=["dense", "moe-keller-scale"])
def test_update_is_newton_schulz_of_each_layer_and_expert(family, rms):
    params, grads, updates = first_update("opt_type=muon", f"muon_weight_decay={WD}", f"muon_consistent_rms={rms}",
                                          *family)
    layer = "moe" if family else "decoder"
    for name in MUON_MATRICES:
        for w, g, u in zip(*(matrices(name, t["layers"][layer][name]) for t in (params, grads, updates))):
            fan_in, fan_out = g.shape
            scale = rms * np.sqrt(max(fan_in, fan_out)) if rms > 0 else np.sqrt(max(1, fan_out / fan_in))
            # The first step's momentum is a multiple of the gradient, and Newton-Schulz normalizes it.
            expected = -LR * (scale * newton_schulz(g) + WD * w)
            np.testing.assert_allclose(u, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max(), err_msg=name)
    if not family:
        return
    # Everything else (embeddings, output head, norms, routers) gets exactly the update of opt_type=adamw.
    _, _, adamw_updates = first_update(*family)
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        if path[-1].key not in MUON_MATRICES:
            np.testing.assert_array_equal(u, leaf_at(adamw_updates, path), err_msg=jax.tree_util.keystr(path))


def leaf_at(tree, path):
    """The leaf at a key path of dict keys."""
    for entry in path:
        tree = tree[entry.key]
    return tree


@pytest.mark.parametrize("model, layer", [("default", "decoder"), ("qwen3-30b-a3b", "moe"), ("qwen2.5-7b", "decoder")])
def test_muon_trains_the_hidden_matrices_adamw_the_rest(model, layer):
    """Embeddings, output head, norms, biases (qwen2.5) and routers (qwen3 MoE) stay with AdamW."""
    config = load_config([BASE_YML, f"model_name={model}"])
    specs = Model.bind(config).param_specs
    labels = jax.tree_util.tree_flatten_with_path(muon.labels(Model.bind(config))(specs))[0]
    assert sorted(jax.tree_util.keystr(p) for p, label in labels if label == "muon") == [
        f"['layers']['{layer}']['{name}']" for name in MUON_MATRICES]
    dims = muon.dimension_numbers
    layers = specs["layers"][layer]
    assert dims(layers["wo"]) == MuonDimensionNumbers((1, 2), (3,))        # [L, N, H, D]
    assert dims(layers["wq"]) == MuonDimensionNumbers((1,), (2, 3))        # [L, D, N, H]
    if layer == "moe":
        assert dims(layers["w_down"]) == MuonDimensionNumbers((2,), (3,))  # [L, E, F, D]: per expert
        assert dims(layers["router"]) is None


def muon_steps(devices, *overrides):
    """The params after three Muon updates with the same random gradients, sharded as a run shards them."""
    run = builder.build(load_config(with_overrides([BASE_YML, *TINY], "opt_type=muon", *MOE, *overrides)),
                        devices=devices)
    p_sharding, o_sharding = run.shardings["params"], run.shardings["opt_state"]
    momentum = o_sharding[1].inner_states["muon"].inner_state[0].mu
    assert momentum["layers"]["moe"]["w_up"] == p_sharding["layers"]["moe"]["w_up"]  # sharded like its parameter

    def step(grads, opt_state, params):
        updates, opt_state = run.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step, in_shardings=(p_sharding, o_sharding, p_sharding), out_shardings=(p_sharding, o_sharding))
    params = jax.jit(Model.bind(run.config).init_params, out_shardings=p_sharding)(jax.random.key(0))
    opt_state = jax.jit(run.tx.init, out_shardings=o_sharding)(params)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), params)
        params, opt_state = step(grads, opt_state, params)
    return jax.tree.map(np.asarray, params)


def test_fsdp_tensor_and_expert_parallel_update_like_one_device():
    """Three Muon steps on 8 devices (FSDP x tensor x expert parallel) equal one device to 1e-5: Newton-Schulz
    sees each layer's and each expert's whole matrix, not shards."""
    ref = muon_steps(jax.devices()[:1], "ici_fsdp_parallelism=1")
    got = muon_steps(jax.devices(), "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")
    for path, want in jax.tree_util.tree_flatten_with_path(ref)[0]:
        np.testing.assert_allclose(leaf_at(got, path), want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_checkpoint_round_trip(tmp_path, cache_dir):  # noqa: F811
    """The saved train state (Muon's momentum, AdamW's moments, counts) restores bitwise, sharded as trained."""
    result = train(tmp_path, "m", cache_dir, "opt_type=muon", "steps=2", "dataset_type=synthetic",
                   "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    restored = checkpoint_files.load_state(str(tmp_path / "m" / "checkpoints" / "2"),
                                           builder.build(result.config).abstract_state)
    assert_bitwise_equal(restored, result.state, "restored Muon train state")
    momentum = restored["opt_state"][1].inner_states["muon"].inner_state[0].mu["layers"]["decoder"]["wq"]
    assert momentum.sharding == result.state["params"]["layers"]["decoder"]["wq"].sharding
    assert float(np.abs(np.asarray(momentum)).max()) > 0


def test_muon_refuses_lora():
    with pytest.raises(ConfigError, match=r"opt_type=muon .* lora_rank=4 .* set opt_type=adamw for LoRA"):
        load_config([BASE_YML, "opt_type=muon", "lora_rank=4"])

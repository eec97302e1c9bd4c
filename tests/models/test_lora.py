"""LoRA: adapters as declared state leaves, merge, only adapters train, export merged and as PEFT."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.checkpointing import peft as peft_export
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.models import lora
from maxtrain import train
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import ParamSpec
from maxtrain import config as config_lib
from post_helpers import compose


def _config(*extra):
    return config_lib.load_config(compose(BASE_YML, *TINY, "lora_rank=4", "lora_alpha=8", *extra))


def test_adapters_follow_the_declarations_and_start_as_the_base_model():
    config = _config("lora_target_modules=[q,o,down]")
    specs = lora.adapter_specs(Model.bind(config))
    layer = specs["layers"]["decoder"]
    assert sorted(layer) == ["w_down", "wo", "wq"]
    assert layer["wq"]["a"].shape == (2, 32, 4) and layer["wq"]["a"].axes == ("layers", "embed", None)
    assert layer["wq"]["b"].shape == (2, 4, 4, 16) and layer["wq"]["b"].axes == ("layers", None, "heads", "head_dim")
    assert layer["wo"]["a"].shape == (2, 4, 16, 4) and layer["wo"]["b"].axes == ("layers", None, "embed")
    params = Model.bind(config).init_params(jax.random.key(0))
    adapters = lora.init(Model.bind(config), jax.random.key(1))
    merged = lora.merge(params, adapters, lora.scale(config))
    jax.tree.map(np.testing.assert_array_equal, merged, params)  # B starts at zero: W' = W


def test_merge_is_w_plus_scaled_a_times_b():
    config = _config()
    params = Model.bind(config).init_params(jax.random.key(0))
    adapters = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), lora.init(Model.bind(config), jax.random.key(1)))
    merged = lora.merge(params, adapters, 2.0)
    wq, ab = params["layers"]["decoder"]["wq"], adapters["layers"]["decoder"]["wq"]
    want = wq + 2.0 * jnp.einsum("LDR,LRNH->LDNH", ab["a"], ab["b"])
    np.testing.assert_allclose(merged["layers"]["decoder"]["wq"], want, rtol=1e-5, atol=1e-5)
    wo, ab = params["layers"]["decoder"]["wo"], adapters["layers"]["decoder"]["wo"]
    np.testing.assert_allclose(merged["layers"]["decoder"]["wo"],
                               wo + 2.0 * jnp.einsum("LNHR,LRD->LNHD", ab["a"], ab["b"]), rtol=1e-5, atol=1e-5)
    host = lora.merge_numpy(jax.device_get(params), jax.device_get(adapters), 2.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), host, merged)
    assert lora.num_adapter_params(Model.bind(config)) == sum(x.size for x in jax.tree.leaves(adapters))


def test_bad_lora_targets_are_refused_before_any_work():
    with pytest.raises(config_lib.ConfigError, match="lora_target_modules=.*q_proj.*q, k, v, o, gate, up, down"):
        _config("lora_target_modules=[q_proj]")
    with pytest.raises(config_lib.ConfigError, match="lora_rank=-1 is not allowed: it must be >= 0"):
        _config("lora_rank=-1")


def test_targets_that_match_no_module_are_refused():
    config = _config("lora_target_modules=[q,gate]")
    model = Model.bind(config)
    specs = model.param_specs  # computed once and kept by the model: changed here, the model sees the change
    gate = specs["layers"]["decoder"]["w_gate"]
    experts = ParamSpec((2, 4) + gate.shape[1:], ("layers", "exp") + gate.axes[1:])  # a mixture of experts
    specs["layers"]["decoder"]["w_gate"] = experts
    with pytest.raises(lora.LoraError, match=r"\['gate'\] match no module of the llama model .*lora_target_modules=\[q\]"):
        lora.adapter_specs(model)


def _hf_logits(model_dir_or_model, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = model_dir_or_model
    if isinstance(model, str):
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.slow  # one tiny training run and three transformers models (~30 s idle)
def test_lora_run_trains_only_adapters_and_exports_merged_and_as_peft(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'maxtrain[post]')")
    args = [BASE_YML, *TINY, f"base_output_directory={tmp_path}", "run_name=lora", "dataset_type=synthetic",
            "steps=3", "eval_interval=-1", "lora_rank=4", "lora_alpha=8", "learning_rate=0.05", "warmup_steps_fraction=0"]
    result = train.main(args)
    config, state = result.config, result.state
    start = jax.jit(lambda k: Model.bind(config).init_params(jax.random.split(k)[0]))(jax.random.key(config.seed))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), jax.device_get(start))  # frozen
    adapters = jax.device_get(state["lora"])
    assert any(np.abs(ab["b"]).max() > 0 for ab in adapters["layers"]["decoder"].values())  # the adapters trained
    # Optimizer state exists for the adapters only: Adam's moments have the adapters' tree and shapes.
    moments = [s for s in jax.tree.leaves(state["opt_state"]) if getattr(s, "ndim", 0) > 0]
    assert sum(m.size for m in moments) == 2 * lora.num_adapter_params(Model.bind(config))

    # Export merges the adapters; the base exported separately plus the PEFT adapter gives the same logits.
    run_dir = tmp_path / "lora"
    convert.export_hf(str(run_dir), str(tmp_path / "merged"))
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    base = tmp_path / "base"
    base.mkdir()
    with open(base / "config.json", "w") as f:
        json.dump(convert.hf_config(keys, None, "float32"), f)
    safetensors_files.write_model_dir(str(base), convert.to_hf(jax.device_get(start), keys, np.float32),
                                      {"format": "pt"}, 2**30)
    saved_adapters, saved = checkpoint_files.read_adapters(str(run_dir))
    peft_export.write_peft(str(tmp_path / "adapter"), saved_adapters, saved)
    tokens = np.random.default_rng(0).integers(4, config.vocab_size, size=(2, 12))
    merged = _hf_logits(str(tmp_path / "merged"), tokens)
    base_model = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(str(base))
    with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter"))
    np.testing.assert_allclose(_hf_logits(with_adapter, tokens), merged, rtol=1e-4, atol=1e-4)
    # ... and both are what maxtrain computes with the merged weights.
    ours, _ = Model.bind(config).forward(lora.merge(start, adapters, lora.scale(config)), jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones((2, 12), jnp.int32), Runtime.from_config(config, "cpu"))
    np.testing.assert_allclose(merged, np.asarray(ours), rtol=1e-4, atol=1e-4)
    assert not np.allclose(_hf_logits(str(base), tokens), merged, atol=1e-3)  # the adapters changed the model
    assert os.path.isfile(tmp_path / "adapter" / "adapter_config.json")
    # load_parameters_path (decode, further training) merges them too.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state["params"])
    loaded = checkpoint_files.load_params(str(run_dir), abstract, config)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), jax.device_get(loaded),
                 lora.merge_numpy(jax.device_get(start), adapters, lora.scale(config)))


def test_reference_and_adapters_are_sharded_from_their_declarations():
    """No hand-listed shardings: DPO's reference is sharded as the params, an adapter's A as its weight's
    input axes and B as its output axes, and the optimizer state exists for the trainable leaves only."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    mesh_args = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "dataset_type=jsonl", "grain_train_files=x",
                 "objective=dpo", "train_data_columns=[prompt,chosen,rejected]",
                 "eval_data_columns=[prompt,chosen,rejected]")
    dpo = builder.build(config_lib.load_config(compose(BASE_YML, *TINY, *mesh_args)))
    assert jax.tree.structure(dpo.shardings["reference"]) == jax.tree.structure(dpo.shardings["params"])
    jax.tree.map(lambda r, p: r.spec == p.spec or pytest.fail(f"{r.spec} != {p.spec}"),
                 dpo.shardings["reference"], dpo.shardings["params"])
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(dpo.shardings["reference"]))

    run = builder.build(_config(*mesh_args, "lora_target_modules=[q,o,down]"))
    assert "reference" not in run.shardings  # with LoRA the frozen params are the reference
    weights, adapters = run.shardings["params"]["layers"]["decoder"], run.shardings["lora"]["layers"]["decoder"]
    for name, inputs in (("wq", 2), ("wo", 3), ("w_down", 2)):  # (layers, input axes...) then output axes
        w = tuple(weights[name].spec) + (None,) * (len(run.abstract_state["params"]["layers"]["decoder"][name].shape)
                                                   - len(weights[name].spec))
        a, b = (tuple(adapters[name][k].spec) for k in ("a", "b"))
        pad = lambda spec, n: spec + (None,) * (n - len(spec))  # noqa: E731
        assert pad(a, inputs + 1) == w[:inputs] + (None,), (name, a, w)
        assert pad(b, len(w) - inputs + 2) == (w[0], None) + w[inputs:], (name, b, w)
    lora_leaves = {(x.shape, s.spec) for x, s in zip(jax.tree.leaves(run.abstract_state["lora"]),
                                                     jax.tree.leaves(run.shardings["lora"]))}
    opt = [(x.shape, s.spec) for x, s in zip(jax.tree.leaves(run.abstract_state["opt_state"]),
                                             jax.tree.leaves(run.shardings["opt_state"])) if x.ndim > 0]
    assert opt and all(leaf in lora_leaves for leaf in opt)
    assert sum(np.prod(shape) for shape, _ in opt) == 2 * lora.num_adapter_params(Model.bind(run.config))  # Adam's mu and nu

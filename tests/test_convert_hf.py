"""Hugging Face interop that needs no transformers: the safetensors reader and writer, pickle refusal,
and an imported checkpoint loading into a sharded model. The families' logits against transformers
are tests/test_families.py."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ckpt_helpers import REPO, args, cache_dir  # noqa: F401  (cache_dir is a fixture)
from maxtrain.checkpointing import files as checkpoint_files, convert, safetensors_files
from maxtrain import models
from maxtrain.parallel import sharding
from maxtrain import config as config_lib

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def maxtrain_config(overrides: dict):
    return config_lib.load_config([str(REPO / "configs" / "base.yml"),
                                   *[f"{k}={convert.yaml_value(v)}" for k, v in overrides.items()]])


def test_safetensors_round_trip_and_bfloat16(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.normal(size=(3, 5)).astype(np.float32),
               "b": rng.normal(size=(7,)).astype(ml_dtypes.bfloat16),
               "c": np.arange(6, dtype=np.int64).reshape(2, 3)}
    path = str(tmp_path / "x.safetensors")
    safetensors_files.write(path, tensors, {"format": "pt"})
    back = safetensors_files.read(path)
    assert list(back) == list(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and back[k].tobytes() == tensors[k].tobytes()
    with open(path, "r+b") as f:  # a header length past the end of the file
        f.write((10**9).to_bytes(8, "little"))
    with pytest.raises(safetensors_files.FormatError, match="not a safetensors file"):
        safetensors_files.read(path)


def test_pickle_files_are_refused_unopened(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not even a valid pickle")
    with pytest.raises(safetensors_files.FormatError, match=r"pickle files and are never loaded"):
        safetensors_files.read_model_dir(str(tmp_path))


def test_imported_checkpoint_loads_into_a_sharded_model_and_refuses_full_state(tmp_path, cache_dir):  # noqa: F811
    """Params only: load_parameters_path takes it (sharded), load_full_state_path says why not."""
    overrides = {"base_emb_dim": 32, "base_num_query_heads": 2, "base_num_kv_heads": 2, "base_mlp_dim": 64,
                 "base_num_decoder_layers": 2, "head_dim": 16, "vocab_size": 512, "rope_max_timescale": 10000.0,
                 "normalization_layer_epsilon": 1e-5, "logits_via_embedding": False}
    config = maxtrain_config(overrides)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), models.param_specs(config),
                          is_leaf=models.is_spec)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    keys = {k: getattr(config, k) for k in models.MODEL_KEYS}
    safetensors_files.write(str(hf_dir / "model.safetensors"), convert.to_hf(params, keys, np.float32))
    (hf_dir / "config.json").write_text(json.dumps(convert.hf_config(keys, None, "float32")))
    convert.import_hf(str(hf_dir), str(tmp_path / "mt"))

    config = config_lib.with_devices(config.replace(ici_fsdp_parallelism=4, ici_tensor_parallelism=2), 8)
    mesh = sharding.create_mesh(config)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sharding.named_sharding(
        mesh, s.axes, config.logical_axis_rules)), models.param_specs(config), is_leaf=models.is_spec)
    loaded = checkpoint_files.load_params(str(tmp_path / "mt"), abstract, config)
    assert loaded["layers"]["decoder"]["wq"].sharding == abstract["layers"]["decoder"]["wq"].sharding
    assert np.asarray(loaded["layers"]["decoder"]["wq"]).tobytes() == params["layers"]["decoder"]["wq"].tobytes()

    from maxtrain import train  # pylint: disable=import-outside-toplevel

    with pytest.raises(checkpoint_files.CheckpointError, match="holds parameters only") as error:
        train.main(args(tmp_path, "full", cache_dir, f"load_full_state_path={tmp_path}/mt"))
    assert "missing from the checkpoint  opt_state (26 arrays)" in str(error.value)
    assert "missing from the checkpoint  step\n" in str(error.value)

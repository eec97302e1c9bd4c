"""Starting from an imported model: its settings are adopted when the command names no model, and a
model whose settings differ from the checkpoint's (same shapes, other numbers) is refused before training.
No transformers needed: the Hugging Face directory is written from random params with maxtrain's exporter."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from ckpt_helpers import REPO
from maxtrain.checkpointing import adoption, convert, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain import train
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.params import is_spec
from maxtrain import config as config_lib
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data import tokenizer_training

RUN = ["dataset_type=synthetic", "steps=2", "per_device_batch_size=1", "max_target_length=32", "eval_interval=-1",
       "max_new_tokens=0", "enable_tensorboard=false", "log_period=1000", "dtype=float32"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny Gemma 2 (sliding windows, soft-caps, its own scale) imported from a Hugging Face directory."""
    tmp = tmp_path_factory.mktemp("imported")
    cfg = config_lib.load_config([str(REPO / "configs" / "base.yml"), "decoder_block=gemma2", "base_emb_dim=32",
                                  "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=16", "base_mlp_dim=64",
                                  "base_num_decoder_layers=2", "vocab_size=320", "sliding_window_size=8",
                                  "attn_logits_soft_cap=20.0", "final_logits_soft_cap=15.0",
                                  "query_pre_attn_scalar=16.0", "normalization_layer_epsilon=1.0e-6",
                                  "logits_via_embedding=true"])
    keys = {k: getattr(cfg, k) for k in model_keys.MODEL_KEYS}
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.2 * rng.normal(size=s.shape)).astype(np.float32), Model.bind(cfg).param_specs,
                          is_leaf=is_spec)
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    safetensors_files.write(str(hf_dir / "model.safetensors"), convert.to_hf(params, keys, np.float32))
    (hf_dir / "config.json").write_text(json.dumps(convert.hf_config(keys, None, "float32")))
    # A byte-level BPE tokenizer.json with its config files, as Hugging Face repositories have them.
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(400)]
    tokenizer_training.train_hf(texts, 300).write(str(hf_dir))
    convert.import_hf(str(hf_dir), str(tmp / "out"), log=lambda *a: None)
    return tmp / "out", keys


@pytest.mark.slow
def test_load_parameters_path_alone_adopts_the_model_and_trains(imported, tmp_path, capsys):
    out, keys = imported
    result = train.main([str(REPO / "configs" / "base.yml"), *RUN, f"load_parameters_path={out}",
                         f"base_output_directory={tmp_path}", "run_name=ft"])
    printed = capsys.readouterr().out
    assert "using the model settings of" in printed and "(gemma2," in printed
    config = result.config
    assert {k: getattr(config, k) for k in model_keys.MODEL_KEYS} == keys
    # The run's checkpoints keep the import's source, so an export writes the original config.json.
    meta = checkpoint_files.read_metadata(checkpoint_files.find_step_dir(str(tmp_path / "ft")))
    assert meta["source"]["hf_config"]["model_type"] == "gemma2"


def test_an_imported_model_fine_tunes_with_its_own_tokenizer_and_exports_with_it(imported, tmp_path, capsys):
    """load_parameters_path=OUT alone: the model and its Hugging Face tokenizer are adopted, the default corpus
    is tokenized with that tokenizer, and the export carries the original config.json and the tokenizer."""
    out, keys = imported
    result = train.main(config_lib.with_overrides(
        [str(REPO / "configs" / "base.yml"), *RUN], "dataset_type=default", "default_corpus_max_mb=0.2",
        "eval_interval=-1", f"dataset_cache_dir={tmp_path / 'cache'}", f"load_parameters_path={out}",
        f"base_output_directory={tmp_path}", "run_name=ft_tok"))
    assert f"and its tokenizer {out}/hf" in capsys.readouterr().out
    assert result.config.tokenizer_path == str(out / "hf")
    exported = tmp_path / "export"
    convert.export_hf(str(tmp_path / "ft_tok"), str(exported), "float32", log=lambda *a: None)
    original = json.loads((out / "hf" / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == {**original, "torch_dtype": "float32",
                                                                  "dtype": "float32"}
    assert (exported / "tokenizer.json").read_bytes() == (out / "hf" / "tokenizer.json").read_bytes()
    assert (exported / "generation_config.json").is_file()
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    text = "def f7(x):\n    return x"
    theirs = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert theirs(text, add_special_tokens=False)["input_ids"] == tokenizer_lib.load(str(out / "hf")).encode(text)
    assert theirs(text)["input_ids"] == tokenizer_lib.prompt_ids(tokenizer_lib.load(str(out / "hf")), text)  # BOS


@pytest.mark.parametrize("change", ["rope_max_timescale=20000.0", "normalization_layer_epsilon=1.0e-5",
                                    "attn_logits_soft_cap=30.0", "sliding_window_size=4", "decoder_block=gemma3"])
def test_a_model_with_other_settings_is_refused_naming_both_values(imported, tmp_path, change):
    out, keys = imported
    model = [f"{k}={_cli(v)}" for k, v in keys.items() if k != change.split("=")[0]]
    key, value = change.split("=")
    if key == "decoder_block":  # gemma3 adds qk-norm parameters: the fit check names them first
        with pytest.raises(checkpoint_files.CheckpointError, match="q_norm"):
            train.main([str(REPO / "configs" / "base.yml"), *RUN, *model, change, f"load_parameters_path={out}",
                        f"base_output_directory={tmp_path}", "run_name=x"])
        return
    with pytest.raises(checkpoint_files.CheckpointError) as error:
        train.main([str(REPO / "configs" / "base.yml"), *RUN, *model, change, f"load_parameters_path={out}",
                    f"base_output_directory={tmp_path}", "run_name=x"])
    message = str(error.value)
    assert f"{key}: checkpoint {keys[key]!r}, this run {float(value) if '.' in value else int(value)!r}" in message
    assert not (tmp_path / "x" / "checkpoints" / "2").exists()


def test_resuming_with_a_changed_setting_is_refused(imported, tmp_path):
    out, _ = imported
    common = [str(REPO / "configs" / "base.yml"), *RUN, f"load_parameters_path={out}",
              f"base_output_directory={tmp_path}", "run_name=r"]
    train.main(common)
    saved = config_lib.load_config(common)
    with pytest.raises(checkpoint_files.CheckpointError, match="rope_max_timescale: checkpoint 10000.0, this run 5.0"):
        train.main(config_lib.with_overrides(common, "steps=4", "rope_max_timescale=5.0", *[
            f"{k}={_cli(getattr(adoption.adopt_model_settings(saved, log=lambda *a: None), k))}"
            for k in model_keys.MODEL_KEYS if k != "rope_max_timescale"]))


def _cli(value) -> str:
    """A model key's value as a command-line override writes it: a string as it is (the command line takes
    strings literally: vision_config's "" or its JSON), anything else as YAML reads it back."""
    return value if isinstance(value, str) else convert.yaml_value(value)

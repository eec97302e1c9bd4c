"""Hugging Face interop that needs no transformers: the safetensors reader and writer, pickle refusal,
and an imported checkpoint loading into a sharded model. The families' logits against transformers
are tests/models/test_families.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ckpt_helpers import REPO, args, cache_dir  # noqa: F401  (cache_dir is a fixture)
from maxtrain.checkpointing import files as checkpoint_files, convert, safetensors_files
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.params import is_spec
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
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), Model.bind(config).param_specs,
                          is_leaf=is_spec)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    safetensors_files.write(str(hf_dir / "model.safetensors"), convert.to_hf(params, keys, np.float32))
    (hf_dir / "config.json").write_text(json.dumps(convert.hf_config(keys, None, "float32")))
    convert.import_hf(str(hf_dir), str(tmp_path / "mt"))

    config = config_lib.with_devices(config.replace(ici_fsdp_parallelism=4, ici_tensor_parallelism=2), 8)
    mesh = sharding.create_mesh(config)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sharding.named_sharding(
        mesh, s.axes, config.logical_axis_rules)), Model.bind(config).param_specs, is_leaf=is_spec)
    loaded = checkpoint_files.load_params(str(tmp_path / "mt"), abstract, config)
    assert loaded["layers"]["decoder"]["wq"].sharding == abstract["layers"]["decoder"]["wq"].sharding
    assert np.asarray(loaded["layers"]["decoder"]["wq"]).tobytes() == params["layers"]["decoder"]["wq"].tobytes()

    from maxtrain import train  # pylint: disable=import-outside-toplevel

    with pytest.raises(checkpoint_files.CheckpointError, match="holds parameters only") as error:
        train.main(args(tmp_path, "full", cache_dir, f"load_full_state_path={tmp_path}/mt"))
    assert "missing from the checkpoint  opt_state (26 arrays)" in str(error.value)
    assert "missing from the checkpoint  step\n" in str(error.value)


# --------------------------------------------------------------------------------------------
# The export's tokenizer: transformers tokenizes as maxtrain trained
# --------------------------------------------------------------------------------------------

SAMPLE = "def f(x):\n    return x + 12345\n\n  two spaces,\ttab, ünïcödé 日本語 🙂\n\nend "


def test_a_default_corpus_run_exports_its_tokenizer_unasked(tmp_path, cache_dir):  # noqa: F811
    """The run keeps a copy of its sentencepiece tokenizer; the export writes a tokenizer.json, tokenizer_config.json
    (BOS added) and the ids in config.json / generation_config.json; transformers gives maxtrain's ids, BOS
    included. A run from before the copy (none in its metadata) exports the default corpus' tokenizer too."""
    from maxtrain import train  # pylint: disable=import-outside-toplevel
    from maxtrain.data import tokenizer as tokenizer_lib, tokenizer_hf  # pylint: disable=import-outside-toplevel

    result = train.main(args(tmp_path, "run", cache_dir, "steps=1", "enable_checkpointing=true"))
    tok = tokenizer_lib.load(str(tmp_path / "run" / "metadata" / "tokenizer"))
    meta = checkpoint_files.read_metadata(checkpoint_files.find_step_dir(str(tmp_path / "run")))
    assert meta["tokenizer"]["checksum"] == tok.checksum and tok.kind == "sentencepiece" and tok.bos_id is not None
    out = tmp_path / "hf"
    assert convert_hf_main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir(out))
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"], config["add_eos_token"]) == \
        (tok.piece(tok.bos_id), tok.piece(tok.eos_id), True, False)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    # The whole eval split of the corpus (~15k tokens) through the exported tokenizer.json, without transformers.
    from maxtrain.data import default_corpus  # pylint: disable=import-outside-toplevel

    texts = [SAMPLE, *default_corpus.load_documents(result.config.default_corpus_max_mb, 0.05)[1]]
    tokenizer_hf.check_same_ids(tok, json.loads((out / "tokenizer.json").read_text()), texts)

    # A run from before the copy: the default corpus' own tokenizer, from the run's cache_dir.
    import shutil  # pylint: disable=import-outside-toplevel

    shutil.rmtree(tmp_path / "run" / "metadata" / "tokenizer")
    assert convert.run_tokenizer({**meta, "tokenizer": None}, None).checksum == tok.checksum
    with pytest.raises(convert.ConversionError, match="is not the one the run trained with"):
        convert.run_tokenizer({**meta, "tokenizer": {**meta["tokenizer"], "checksum": "0" * 16}}, None)

    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in (SAMPLE, *tokenizer_hf.PROBES, "a literal <s> and </s> in the text"):
        assert theirs(text)["input_ids"] == tokenizer_lib.prompt_ids(tok, text), text
    assert theirs.decode(theirs(SAMPLE)["input_ids"], skip_special_tokens=True) == SAMPLE


def convert_hf_main(argv: list[str]) -> int:
    """`python scripts/convert_hf.py ARGV`, as a user runs it: its exit status (its output shown on failure)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_hf.py"), *argv], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.returncode


def test_a_hugging_face_tokenizer_is_exported_to_add_bos_as_maxtrain_does(tmp_path):
    """A tokenizer.json whose post-processor adds nothing, with a tokenizer_config.json naming a BOS that maxtrain
    therefore adds: the export's post-processor adds it too; a bare tokenizer.json (no BOS) exports as it is."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

    from maxtrain.data import tokenizer as tokenizer_lib, tokenizer_hf  # pylint: disable=import-outside-toplevel

    backend = Tokenizer(tok_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([SAMPLE * 3, "return x\n" * 20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    (tmp_path / "tokenizer.json").write_text(backend.to_str())
    bare = tokenizer_lib.load(str(tmp_path / "tokenizer.json"))
    files, notes = tokenizer_hf.hf_files(bare)
    assert files["tokenizer.json"] == bare.files["tokenizer.json"] and not notes
    assert json.loads(files["tokenizer_config.json"])["add_bos_token"] is False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                                "chat_template": "{{ messages }}"}))
    named = tokenizer_lib.load(str(tmp_path))
    files, notes = tokenizer_hf.hf_files(named)
    assert "post-processor" in notes[0]
    config = json.loads(files["tokenizer_config.json"])
    assert (config["bos_token"], config["add_bos_token"], config["chat_template"]) == ("<bos>", True, "{{ messages }}")
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    for tok, written in ((bare, tokenizer_hf.hf_files(bare)[0]), (named, files)):
        out = tmp_path / f"export_{tok.bos_id}"
        out.mkdir()
        for name, data in written.items():
            (out / name).write_bytes(data)
        assert transformers.AutoTokenizer.from_pretrained(str(out))(SAMPLE)["input_ids"] == \
            tokenizer_lib.prompt_ids(tok, SAMPLE)


def test_a_sentencepiece_model_with_multi_character_symbols_exports_its_model_alone():
    """ChatML markers as user-defined symbols: no tokenizer.json gives sentencepiece's ids (its dummy prefix comes
    before a leading symbol), so the export carries tokenizer.model alone and says so."""
    import io  # pylint: disable=import-outside-toplevel

    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    from maxtrain.data import tokenizer as tokenizer_lib, tokenizer_hf  # pylint: disable=import-outside-toplevel

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([SAMPLE, "<|im_start|>user\nhi<|im_end|>\n"] * 20),
                                   model_writer=model, vocab_size=330, model_type="bpe", byte_fallback=True,
                                   hard_vocab_limit=False,
                                   user_defined_symbols=["\n", "<|im_start|>", "<|im_end|>"], minloglevel=2)
    tok = tokenizer_lib.from_files({tokenizer_lib.SP_MODEL: model.getvalue()}, "chatml.model")
    files, notes = tokenizer_hf.hf_files(tok)
    assert sorted(files) == ["tokenizer.model", "tokenizer_config.json"] and "user-defined symbols" in notes[0]
    config = json.loads(files["tokenizer_config.json"])
    assert (config["tokenizer_class"], config["bos_token"], config["add_bos_token"]) == ("LlamaTokenizer", "<s>", True)

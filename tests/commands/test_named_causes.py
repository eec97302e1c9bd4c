"""Errors that name their real cause, where the bad-input table (tests/bad_inputs/) cannot reach: a GRPO row
whose prompt is empty, evaluation requests a tokenizer cannot encode, the glob suggested for a directory,
and the import's checks of config.json (direct calls on tiny inputs; no model is built or trained)."""

from __future__ import annotations

import json

import pytest

from maxtrain import config as config_lib
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.data import DataError, chat, prompts, text_files, tokenizer_training
from maxtrain.evals import requests as requests_lib


@pytest.fixture(scope="module")
def template():
    texts = [f"question {i}: what is {i} + {i}? the answer is {2 * i}." for i in range(300)]
    return chat.template_for(tokenizer_training.train_sentencepiece(texts, vocab_size=300), "plain")


@pytest.mark.parametrize("prompt", ["", "   ", [{"role": "user", "content": " "}]])
def test_a_grpo_row_with_an_empty_prompt_names_the_record_and_the_column(template, prompt):
    to_prompt = prompts.ToPrompt(template, ["question", "answer"], 64, "eval_data_columns")
    with pytest.raises(DataError, match=r"^held.jsonl line 3: the prompt \(column 'question'\) is empty"):
        to_prompt.prompt(("held.jsonl line 3", {"question": prompt, "answer": "4"}))
    assert len(to_prompt.prompt(("held.jsonl line 4", {"question": "2 + 2?", "answer": "4"})).ids) > 0


def test_a_grpo_row_without_its_columns_names_the_key_of_its_split(template):
    for key in ("train_data_columns", "eval_data_columns"):
        with pytest.raises(DataError, match=rf"the record has: q, a\). Fix the row, or name the fields with {key}="):
            prompts.ToPrompt(template, ["prompt", "answer"], 64, key).prompt(("x.jsonl line 1", {"q": "1", "a": "2"}))


class _NoSpecialTokens:
    """A tokenizer without BOS and EOS that drops white space (what requests.tokenize reads)."""
    bos_id = eos_id = None
    path = "bare/tokenizer.json"

    def encode_batch(self, texts):
        return [[ord(c) for c in t if not c.isspace()] for t in texts]


def test_evaluation_requests_a_tokenizer_cannot_encode_are_config_errors_naming_it():
    tok = _NoSpecialTokens()
    with pytest.raises(config_lib.ConfigError, match=r"the tokenizer bare/tokenizer.json has neither a BOS nor an EOS"):
        requests_lib.tokenize([("", "the end")], tok)
    with pytest.raises(config_lib.ConfigError, match=r"the continuation ' ' .* gives no tokens of its own with the "
                                                     r"tokenizer bare/tokenizer.json"):
        requests_lib.tokenize([("question", " ")], tok)
    with pytest.raises(config_lib.ConfigError, match=r"raise eval_tasks_max_target_length to at least 9"):
        requests_lib.pack([([1], list(range(9)))], 8)


def test_a_directory_given_as_a_glob_is_named_with_a_glob_of_its_files(tmp_path):
    (tmp_path / "prep").mkdir()
    for name in ("train-00000-of-00002.arrayrecord", "train-00001-of-00002.arrayrecord",
                 "eval-00000-of-00001.arrayrecord", "metadata.json"):
        (tmp_path / "prep" / name).write_text("x")
    (tmp_path / "raw" / "web").mkdir(parents=True)
    (tmp_path / "raw" / "web" / "a.jsonl.gz").write_bytes(b"")
    prep, raw = str(tmp_path / "prep"), str(tmp_path / "raw")
    said = text_files.unmatched(prep, ("arrayrecord",), "eval-")
    assert said == (f"is a directory, not a glob of files: name its files, e.g. '{prep}/eval-*.arrayrecord' (it holds "
                    "3 .arrayrecord, 1 .json files)")
    assert "read it with dataset_type=arrayrecord and" in text_files.unmatched(prep + "/", ("parquet",), "train-")
    assert f"e.g. '{raw}/**/*.jsonl.gz' (its files are in subdirectories)" in text_files.unmatched(raw, ("jsonl",))
    assert text_files.unmatched(str(tmp_path / "none" / "*.jsonl")) == (
        f"matches no files (the directory {tmp_path / 'none'} does not exist)")


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512}


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 3}, r"describes a llama model that maxtrain's llama family cannot build: .*"
                                 r"base_num_kv_heads=3"),
    ({"vocab_size": -5}, r"config.json: vocab_size=-5 is not a positive integer"),
    ({"model_type": ["llama"]}, r"model_type=\['llama'\] is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"is missing or has a malformed field for a llama model "
                                                               r"\(KeyError: 'low_freq_factor'\)"),
    ({"num_nextn_predict_layers": 1.5}, r"num_nextn_predict_layers=1.5 is not a count of modules"),
])
def test_import_refuses_a_config_json_it_cannot_build_naming_the_file(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **change}))
    safetensors_files.write(str(tmp_path / "model.safetensors"), {})
    with pytest.raises(convert.ConversionError, match=message) as error:
        convert.import_hf(str(tmp_path), str(tmp_path / "out"), log=lambda *_: None)
    assert "model_type" in change or str(error.value).startswith(str(tmp_path / "config.json"))

"""Downstream evaluation over 2 real JAX processes (gloo on localhost) x 4 CPU devices: the requests are
split between the processes and their devices, and the scores equal one process' over 8 devices,
example by example: none is scored twice or dropped.

Runs `python -m maxtrain.evaluate` as a user would, on a tiny params-only checkpoint written through
the Hugging Face importer and a sentencepiece tokenizer trained here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from eval_helpers import BASE, REPO, eval_cache  # noqa: F401  (fixture)
from maxtrain import config as config_lib
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data import tokenizer_training

TASKS = ["arc_easy", "winogrande", "lambada"]
MODEL = {"base_emb_dim": 32, "base_num_query_heads": 2, "base_num_kv_heads": 2, "base_mlp_dim": 64,
         "base_num_decoder_layers": 2, "head_dim": 16, "vocab_size": 512, "rope_max_timescale": 10000.0,
         "normalization_layer_epsilon": 1e-5, "logits_via_embedding": False}


def _checkpoint_and_tokenizer(tmp_path, cache: str) -> tuple[str, str]:
    from maxtrain.evals import data as data_lib  # pylint: disable=import-outside-toplevel

    files = data_lib.open_cache(cache, ["arc_easy"])
    texts = [r["question"] + " " + " ".join(r["choices"]["text"]) for r in data_lib.read_rows(files["arc_easy"]["validation"])]
    tok_path = tmp_path / "tok.model"
    tok_path.write_bytes(tokenizer_training.train_sentencepiece(texts, vocab_size=512).files[tokenizer_lib.SP_MODEL])
    config = config_lib.load_config([BASE, *[f"{k}={convert.yaml_value(v)}" for k, v in MODEL.items()]])
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    params = jax.tree.map(np.asarray, Model.bind(config).init_params(jax.random.key(7)))
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors_files.write(str(hf / "model.safetensors"), convert.to_hf(params, keys, np.float32))
    (hf / "config.json").write_text(json.dumps(convert.hf_config(keys, None, "float32")))
    convert.import_hf(str(hf), str(tmp_path / "mt"))
    return str(tmp_path / "mt"), str(tok_path)


def _args(tmp_path, cache, ckpt, tok, run_name):
    return [BASE, *[f"{k}={convert.yaml_value(v)}" for k, v in MODEL.items()], f"eval_tasks={','.join(TASKS)}",
            "eval_tasks_max_examples=25", "eval_tasks_max_target_length=256", "eval_tasks_per_device_batch_size=1",
            f"eval_tasks_cache_dir={cache}", f"load_parameters_path={ckpt}", f"tokenizer_path={tok}",
            "dataset_type=synthetic", "dtype=float32", f"base_output_directory={tmp_path}", f"run_name={run_name}",
            "eval_tasks_log_samples=true"]


@pytest.mark.slow  # two JAX processes start, compile and score: ~1 minute on 2 cores
def test_two_processes_score_every_request_once_and_agree_with_one(tmp_path, eval_cache):  # noqa: F811
    from maxtrain import evaluate  # pylint: disable=import-outside-toplevel

    ckpt, tok = _checkpoint_and_tokenizer(tmp_path, eval_cache)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", "maxtrain.evaluate", *_args(tmp_path, eval_cache, ckpt, tok, "two"),
                               f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={i}"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    one = evaluate.main(_args(tmp_path, eval_cache, ckpt, tok, "one"))  # meanwhile: 1 process x 8 devices
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    # 3 tasks x 25 examples = 75, split 38 / 37 examples; arc_easy has some 3- and 5-choice questions
    total = sum(len(one[t]["samples"]) if t == "lambada" else sum(len(s["lls"]) for s in one[t]["samples"]) for t in TASKS)
    counts = json.loads(logs[0].split("requests (per process ")[1].split(")")[0])
    assert len(counts) == 2 and sum(counts) == total and min(counts) > 0, logs[0][-3000:]
    for task in TASKS:
        with open(tmp_path / "two" / "eval_tasks" / "step_0" / f"{task}.jsonl") as f:
            two = [json.loads(line) for line in f]
        mine = one[task]["samples"]
        assert [s["doc_id"] for s in two] == [s["doc_id"] for s in mine] == [str(i) for i in range(25)]
        for a, b in zip(two, mine):
            assert np.allclose(a.get("lls", [a.get("ll")]), b.get("lls", [b.get("ll")]), atol=1e-4), (task, a, b)
            assert a.get("pred") == b.get("pred") and a.get("is_greedy") == b.get("is_greedy")
    summary = json.loads((tmp_path / "two" / "eval_tasks.json").read_text())["final"]
    assert summary["arc_easy"]["acc"] == one["arc_easy"]["acc"]
    assert summary["lambada"]["perplexity"] == pytest.approx(one["lambada"]["perplexity"], rel=1e-5)

"""Two real JAX processes (gloo on localhost): disjoint host shards, padding batches, eval identical to 1 host.

One 2-process run serves every assertion here (starting processes is the slow part).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import data_helpers as h
import pytest
from data_multihost_worker import STEPS

TRAIN_DOCS = 61   # odd: the hosts get 31 and 30 documents, so their data ends at different steps
EVAL_DOCS = 7


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tok = h.tokenizer_path(tmp_path_factory)
    corpus = h.prepared(tmp_path_factory, "multihost_corpus", h.texts(TRAIN_DOCS, "m"), tok)
    eval_dir = h.prepared(tmp_path_factory, "multihost_eval", h.texts(EVAL_DOCS, "e", min_words=30, max_words=90), tok)
    for name in os.listdir(eval_dir):  # one directory: train-* and eval-* shards with one tokenizer
        if name.endswith(".arrayrecord"):
            os.rename(os.path.join(eval_dir, name), os.path.join(corpus, name.replace("train-", "eval-")))
    with open(os.path.join(eval_dir, "metadata.json")) as f:
        eval_meta = json.load(f)
    with open(os.path.join(corpus, "metadata.json")) as f:
        meta = json.load(f)
    meta["shards"].update({k.replace("train-", "eval-"): v for k, v in eval_meta["shards"].items()})
    with open(os.path.join(corpus, "metadata.json"), "w") as f:
        json.dump(meta, f)

    out = tmp_path_factory.mktemp("multihost")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data_multihost_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), corpus, str(out / f"host{i}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    hosts = []
    for i in range(2):
        with open(out / f"host{i}.json") as f:
            hosts.append(json.load(f))
    return {"hosts": hosts, "corpus": corpus, "logs": logs, "out": out}


@pytest.mark.slow  # these four share `run`: two JAX processes over an epoch, 42 s on 2 busy cores
def test_no_document_is_read_by_both_hosts_over_an_epoch(run):
    tags = [set(host["tags"]) for host in run["hosts"]]
    assert all(len(host["tags"]) == len(set(host["tags"])) for host in run["hosts"])  # once per host
    assert not tags[0] & tags[1]
    assert tags[0] | tags[1] == {f"m-{i}" for i in range(TRAIN_DOCS)}  # together: the whole epoch
    assert {len(t) for t in tags} == {30, 31}


@pytest.mark.slow
def test_padding_batches_keep_the_hosts_in_step_after_their_data_ends(run):
    a, b = run["hosts"]
    assert a["real_batches"] + a["padding_batches"] == b["real_batches"] + b["padding_batches"] == STEPS
    assert a["padding_batches"] > 0 and b["padding_batches"] > 0
    # every global step summed both hosts' rows: the global weight is the sum of the local ones
    assert a["global_weight"] == b["global_weight"] == a["local_weight"] + b["local_weight"]


@pytest.mark.slow
def test_eval_epoch_runs_the_same_batch_count_on_both_hosts(run):
    a, b = run["hosts"]
    assert a["eval_batches"] == b["eval_batches"] == max(a["eval_real_batches"], b["eval_real_batches"])
    assert a["eval_real_batches"] != b["eval_real_batches"]  # uneven: one host padded


@pytest.mark.slow
def test_eval_loss_is_the_same_on_one_and_on_two_hosts(run):
    from data_multihost_worker import common, eval_loss_at_init  # pylint: disable=import-outside-toplevel

    single, evals = eval_loss_at_init(h.config(*common(run["corpus"]), devices=8))
    assert len(evals) == evals.real_batches  # one host: no padding batches
    two = [host["eval_loss"] for host in run["hosts"]]
    assert two[0] == two[1]
    # the same parameters (seeded init) and eval documents, packed into batches differently
    assert two[0] == pytest.approx(single, rel=1e-5)

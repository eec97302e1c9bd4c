"""Elastic resume end to end: saved by 2 processes x 2 devices, resumed on 1 x 4 and on 1 x 8.

Real local processes run `maxtrain.train` (through tests/elastic_worker.py, which records every host
batch the run reads and changes nothing else):

    saved      2 processes x 2 CPU devices (fsdp 4), steps 1-3 on a prepared arrayrecord corpus,
               checkpoint at step 3 (each process' Grain iterator state saved beside the state)
    on 1 x 4   1 process x 4 devices, fsdp 2 x tensor 2: resumes step 3, reads to the epoch's end
    on 1 x 8   1 process x 8 devices, data 2 x fsdp 2 x tensor 2, a copy of the same checkpoint

Orbax reshards the state onto each new mesh, the two saved iterator states are merged into one
(data/elastic.py), and over the whole epoch, what the two processes read before the checkpoint plus
what the one process read after it, every document of the corpus is read exactly once (counted with
test_elastic.py's helpers: BOS-to-EOS documents, the one a process was cutting into rows joined from
its head and tail). The start-up summary says the resume is elastic.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data_helpers as h
from maxtrain.config import with_overrides
from test_elastic import documents_read, epoch_documents, joined, host_stream, is_padding
from processes import env_with, finish, free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parents[1] / "elastic_worker.py")
DOCS, LENGTH, SAVED_AT = 37, 16, 3
MODEL = with_overrides(h.TINY_MODEL, "base_num_kv_heads=2")  # tensor parallelism 2 divides every head count


def start(prefix: Path, args: list[str], devices: int, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, WORKER, str(prefix), "configs/base.yml", *args], cwd=ROOT,
                                env=env_with(devices), stdout=f, stderr=subprocess.STDOUT)


def read_tap(path: Path) -> list[dict]:
    fields = np.load(path)
    return [{k: fields[k][i] for k in fields.files} for i in range(len(fields["inputs"]))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tok = h.tokenizer_path(tmp_path_factory)
    corpus = h.prepared(tmp_path_factory, "elastic_resume_corpus", h.texts(DOCS, "r"), tok)
    data = ["dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord",
            f"max_target_length={LENGTH}", "per_device_batch_size=1", "num_epoch=1",
            "generate_padding_batch_train=true"]
    config = h.config(*data, *MODEL)
    epoch = epoch_documents(config)
    tokens = sum(len(d) * n for d, n in epoch.items())
    out = tmp_path_factory.mktemp("elastic_resume")
    common = [*MODEL, *data, f"base_output_directory={out}", "eval_interval=-1", "max_new_tokens=0",
              "log_period=1", "async_checkpointing=false", "enable_tensorboard=false",
              f"checkpoint_period={SAVED_AT}", "learning_rate_schedule_steps=100"]

    port = free_port()
    saved = [start(out / "saved", [*common, "run_name=el", f"steps={SAVED_AT}", "ici_fsdp_parallelism=4",
                                   f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={i}"],
                   2, out / f"saved{i}.log") for i in range(2)]
    codes = {"saved": finish(saved, timeout=600)}
    shutil.copytree(out / "el", out / "el8")
    # Enough steps to read the rest of the epoch (then a few zero-weight padding batches); saved at the end only.
    def resume(name, run_name, devices, mesh):
        steps = SAVED_AT + tokens // (devices * LENGTH) + 4
        args = with_overrides(common, f"run_name={run_name}", f"steps={steps}", f"checkpoint_period={steps}", *mesh)
        return start(out / name, args, devices, out / f"{name}.log")

    resumed = {"on4": resume("on4", "el", 4, ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]),
               "on8": resume("on8", "el8", 8, ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                               "ici_tensor_parallelism=2"])}
    for name, proc in resumed.items():
        codes[name] = finish([proc], timeout=600)
    logs = {p.stem: p.read_text() for p in out.glob("*.log")}
    return {"out": out, "codes": codes, "logs": logs, "config": config, "epoch": epoch}


def _check_ok(runs, *names):
    for name in names:
        assert runs["codes"][name] == [0] * len(runs["codes"][name]), "\n".join(
            runs["logs"][k][-3000:] for k in runs["logs"] if k.startswith(name))


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["on4", "on8"])
def test_every_document_is_read_exactly_once_across_the_elastic_resume(runs, resumed):
    _check_ok(runs, "saved", resumed)
    out, bos, eos = runs["out"], 1, 2
    before = [read_tap(out / f"saved-p{i}.npz") for i in range(2)]
    assert [len(b) for b in before] == [SAVED_AT, SAVED_AT]
    after = [b for b in read_tap(out / f"{resumed}-p0.npz") if not is_padding(b)]
    assert after and is_padding(read_tap(out / f"{resumed}-p0.npz")[-1]), "the resumed run did not reach the epoch's end"
    want = runs["epoch"]
    whole, heads, tails = documents_read([host_stream(b, bos, packed=True) for b in (*before, after)], bos, eos)
    got = whole + collections.Counter(joined(heads, tails, set(want)))
    assert got == want, (sum((got - want).values()), "repeated", sum((want - got).values()), "skipped")


@pytest.mark.slow
@pytest.mark.parametrize("resumed, mesh", [("on4", "{'fsdp': 2, 'tensor': 2}"),
                                           ("on8", "{'data': 2, 'fsdp': 2, 'tensor': 2}")])
def test_the_summary_says_the_resume_is_elastic(runs, resumed, mesh):
    _check_ok(runs, "saved", resumed)
    log = runs["logs"][resumed]
    assert f"Resuming from {runs['out']}/{'el' if resumed == 'on4' else 'el8'}/checkpoints/{SAVED_AT}" in log
    assert "elastic resume: saved by 2 process(es) x 4 devices" in log and "Bitwise equality" in log, log[-3000:]
    assert "over 4 devices in 2 process(es)" in runs["logs"]["saved0"]
    mesh_line = next(line for line in log.splitlines() if line.startswith("mesh:"))
    for axis_size in mesh.strip("{}").split(", "):
        assert axis_size in mesh_line, mesh_line

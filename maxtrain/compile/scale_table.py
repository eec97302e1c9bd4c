"""The docs/scale.md table's logic (scripts/scale_table.py is its command): the rows (real models on TPU pods and
H100 clusters), each cell compiled by `maxtrain.train_compile` in a child process of its own or by MaxText's
train_compile, the results file (one JSON line per cell) and the tables written into docs/scale.md."""

from __future__ import annotations

import datetime
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time

import maxtrain
from maxtrain import errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(maxtrain.__file__)))
SCRIPT = "scripts/scale_table.py"  # run in a child process per cell (--cell ROW ATTENTION), from REPO

RESULTS = os.path.join(REPO, "docs", "scale_results.jsonl")
DOC = os.path.join(REPO, "docs", "scale.md")
BEGIN, END = "<!-- scale table: begin (scripts/scale_table.py writes this) -->", "<!-- scale table: end -->"
SAME_BEGIN = "<!-- same-compiler table: begin (scripts/scale_table.py writes this) -->"
SAME_END = "<!-- same-compiler table: end -->"

# Llama 3 70B as MaxText's llama3-70b (no preset of ours yet).
LLAMA3_70B = ["model_name=llama3-8b", "base_emb_dim=8192", "base_num_query_heads=64", "base_num_kv_heads=8",
              "base_mlp_dim=28672", "base_num_decoder_layers=80"]

# key: (label, model overrides, MaxText model_name, compile_topology, slices, max_target_length, extra overrides)
ROWS = {
    "8b-v5p128": ("Llama 3 8B, 8192, v5p-128", ["model_name=llama3-8b"], "llama3-8b", "v5p-128", 1, 8192, []),
    "8b-v5p128-tp4": ("Llama 3 8B, 8192, v5p-128, FSDP 16 x tensor 4", ["model_name=llama3-8b"], "llama3-8b", "v5p-128",
                      1, 8192, ["ici_fsdp_parallelism=16", "ici_tensor_parallelism=4"]),
    "8b-v5e256": ("Llama 3 8B, 4096, v5e-256", ["model_name=llama3-8b"], "llama3-8b", "v5e-256", 1, 4096, []),
    "8b-2xv5e256": ("Llama 3 8B, 4096, 2 x v5e-256", ["model_name=llama3-8b"], "llama3-8b", "v5e-256", 2, 4096, []),
    "70b-v5p1024": ("Llama 3 70B, 4096, v5p-1024", LLAMA3_70B, "llama3-70b", "v5p-1024", 1, 4096, []),
    "8b-h100x8": ("Llama 3 8B, 8192, 8 x H100", ["model_name=llama3-8b"], None, "h100-8", 1, 8192, []),
    "8b-h100x64": ("Llama 3 8B, 8192, 64 x H100", ["model_name=llama3-8b"], None, "h100-64", 1, 8192, []),
    "8b-h100x512": ("Llama 3 8B, 8192, 512 x H100", ["model_name=llama3-8b"], None, "h100-512", 1, 8192, []),
    "70b-h100x8": ("Llama 3 70B, 4096, 8 x H100", LLAMA3_70B, None, "h100-8", 1, 4096, []),
    "70b-h100x64": ("Llama 3 70B, 4096, 64 x H100", LLAMA3_70B, None, "h100-64", 1, 4096, []),
    "70b-h100x512": ("Llama 3 70B, 4096, 512 x H100", LLAMA3_70B, None, "h100-512", 1, 4096, []),
    "qwen3-8b-v5p128": ("Qwen3 8B, 8192, v5p-128", ["model_name=qwen3-8b"], "qwen3-8b", "v5p-128", 1, 8192, []),
    "gemma2-9b-v5p128": ("Gemma 2 9B, 8192, v5p-128", ["model_name=gemma2-9b"], "gemma2-9b", "v5p-128", 1, 8192, []),
    "mixtral-8x7b-v5p128": ("Mixtral 8x7B, 4096, v5p-128", ["model_name=mixtral-8x7b"], "mixtral-8x7b", "v5p-128", 1,
                            4096, []),
}
ATTENTIONS = ("dot_product", "flash")
SAME_COMPILER = "maxtrain-same-compiler"  # maxtrain compiled with MaxText's jax and libtpu
MAXTEXT_PINNED = "maxtext-pinned-libtpu"  # MaxText's train_compile with maxtrain's pinned libtpu
PY312 = "maxtrain-py312"  # maxtrain compiled with the [tpu] / [cuda] extras as they install on Python 3.12
COMMON = ["per_device_batch_size=1", "remat_policy=full", "dtype=bfloat16", "dataset_type=synthetic"]

# MaxText 0.2.5's figures as issue 21 quotes them (measured elsewhere, with another jax/libtpu), for
# the rows whose MaxText cell this machine has not measured.
MAXTEXT_QUOTED = {("8b-v5p128", "dot_product"): 18.7, ("8b-v5p128", "flash"): 8.6, ("8b-v5p128-tp4", "dot_product"): 18.0,
                  ("8b-v5e256", "dot_product"): 5.4, ("8b-v5e256", "flash"): 4.4, ("8b-2xv5e256", "dot_product"): 7.1,
                  ("70b-v5p1024", "dot_product"): 17.1, ("70b-v5p1024", "flash"): 11.6}


def argv_of(key: str, attention: str) -> list[str]:
    _, model, _, topology, slices, length, extra = ROWS[key]
    return ["configs/base.yml", *model, f"compile_topology={topology}", f"compile_topology_num_slices={slices}",
            f"max_target_length={length}", f"attention={attention}", *COMMON, *extra]



def compiler_versions() -> dict:
    """The jax, libtpu and CUDA plugin this process compiles with (they decide how memory is counted)."""
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    out = {}
    for name in ("jax", "libtpu", "jax-cuda12-plugin"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_cell(python: str, key: str, attention: str) -> dict:
    """One maxtrain cell, compiled by `python` in a child process of its own."""
    command = [python, SCRIPT, "--cell", key, attention]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    record = json.loads(lines[-1][7:]) if lines else {
        "error": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or [""])[-1][:300]}
    interpreter = "python" if python == sys.executable else python
    record["command"] = f"{interpreter} -m maxtrain.train_compile " + " ".join(argv_of(key, attention))
    return record


def pinned_libtpu_path(workdir: str) -> tuple[str, str]:
    """(a directory that holds only this Python's libtpu, its version): put first on PYTHONPATH, it makes
    another Python's jax compile with maxtrain's pinned libtpu."""
    version = importlib.metadata.version("libtpu")
    package = os.path.dirname(importlib.util.find_spec("libtpu").origin)
    dist_info = glob.glob(os.path.join(os.path.dirname(package), f"libtpu-{version}.dist-info"))
    path = os.path.join(workdir, f"libtpu-{version}")
    os.makedirs(path, exist_ok=True)
    for source in (package, *dist_info):  # the metadata too, so that the other Python reports this version
        link = os.path.join(path, os.path.basename(source))
        if not os.path.islink(link):
            os.symlink(source, link)
    return path, version


def run_maxtext(python: str, key: str, attention: str, workdir: str, libtpu_path: str | None = None) -> dict:
    """MaxText 0.2.5's train_compile for the same cell; the total memory it prints. With libtpu_path
    (pinned_libtpu_path), compiled by that libtpu instead of MaxText's own."""
    _, _, model, topology, slices, length, extra = ROWS[key]
    if model is None:
        return {"error": "MaxText's train_compile cannot compile for a GPU without one attached"}
    found = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(workdir, exist_ok=True)
    args = [python, "-m", "maxtext.trainers.pre_train.train_compile", os.path.join(found, "configs", "base.yml")]
    args += [f"model_name={model}", f"compile_topology={topology}", f"compile_topology_num_slices={slices}",
             f"max_target_length={length}", "per_device_batch_size=1", "remat_policy=full", "dtype=bfloat16",
             f"attention={attention}", "run_name=scale", f"base_output_directory={workdir}", *extra]
    t0 = time.time()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if libtpu_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (libtpu_path, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(args, capture_output=True, text=True, cwd=workdir, env=env)
    text = proc.stdout + proc.stderr
    suffix = "-pinned-libtpu" if libtpu_path else ""
    with open(os.path.join(workdir, f"{key}-{attention}{suffix}.log"), "w", encoding="utf-8") as f:
        f.write(text)
    total = maxtext_total_gib(text)
    if total is None:
        return {"error": f"exit {proc.returncode}: " + (text.strip().splitlines() or [""])[-1][:300], "command": args[1:]}
    return {"total_gb": total, "seconds": time.time() - t0, "command": args[1:]}


def maxtext_total_gib(text: str) -> float | None:
    """Total per-chip GiB from MaxText's log: its "Memory analysis: CompiledMemoryStats(...)" line
    (arguments + outputs - aliased + temporaries, as max_utils.print_compiled_memory_stats adds them)."""
    fields = dict(re.findall(r"(\w+_size_in_bytes)=(\d+)", text.split("Memory analysis:", 1)[-1].split("\n", 1)[0]))
    if "Memory analysis:" in text and "temp_size_in_bytes" in fields:
        n = {k: int(v) for k, v in fields.items()}
        return (n["argument_size_in_bytes"] + n["output_size_in_bytes"] - n["alias_size_in_bytes"]
                + n["temp_size_in_bytes"]) / 2**30
    match = re.search(r"Total (?:estimated )?memory size:\s*([\d.]+)\s*GB", text)
    return float(match.group(1)) if match else None


def load_results(path: str) -> dict:
    out = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                        out[(record["row"], record["attention"], record["who"])] = record
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise errors.ToolError(f"{path} line {number} is not a cell this script wrote (a JSON object "
                                               "with row, attention and who); remove or fix that line") from None
    return out


def gib(n) -> str:
    return f"{n / 2**30:.1f}"


def cell_text(record: dict | None) -> str:
    if record is None:
        return "not run"
    if "refused" in record:
        return f"does not fit: temporaries alone {record['refused']['temporaries_gib']:.1f} of {record['refused']['available_gib']:.1f}"
    if "error" in record:
        return "fails: " + record["error"].split(": ", 1)[-1][:80].replace("|", "/")
    mem = record["memory"]
    return f"{gib(mem['total'])} ({'fits' if record['fits'] else 'does not fit'})"


def table(results: dict) -> str:
    lines = ["| model, sequence, target | attention | maxtrain GiB/chip (of) | args / temps / outputs | "
             "compile s | all-gather / reduce-scatter / all-reduce / permute GiB per step | MaxText 0.2.5 GiB | ratio "
             "| MaxText 0.2.5 with maxtrain's libtpu, GiB | ratio | what `pip install 'maxtrain[tpu]'` (GPU rows: "
             "`[cuda]`) gives on Python 3.12: GiB/chip, versions |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, (label, *_rest) in ROWS.items():
        for attention in ATTENTIONS:
            ours = results.get((key, attention, "maxtrain"))
            theirs = results.get((key, attention, "maxtext"))
            if ours is None and theirs is None and (key, attention) not in MAXTEXT_QUOTED:
                continue
            if ours and "memory" in ours:
                mem, coll = ours["memory"], ours["collective_bytes"]
                chip = f" of {gib(mem['chip'])}" if mem.get("chip") else ""
                detail = f"{gib(mem['arguments'])} / {gib(mem['temporaries'])} / {gib(mem['outputs'])}"
                comms = " / ".join(f"{coll[k] / 2**30:.1f}" for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                                       "collective-permute"))
                ours_text = cell_text(ours).replace(" (", chip + " (", 1)
                seconds = f"{ours['compile_seconds']:.0f}"
                name = ours["attention"]
            else:
                ours_text, detail, comms, seconds, name = cell_text(ours), "", "", "", attention
            if theirs and "total_gb" in theirs:
                mx = f"{theirs['total_gb']:.1f}"
                mx_gib = theirs["total_gb"]
            elif (key, attention) in MAXTEXT_QUOTED:
                mx_gib = MAXTEXT_QUOTED[(key, attention)]
                mx = f"{mx_gib} (issue 21)"
            elif ROWS[key][2] is None:
                mx, mx_gib = "cannot compile without a GPU", None
            else:
                mx, mx_gib = (cell_text(theirs) if theirs else "not run"), None
            ratio = f"{ours['memory']['total'] / 2**30 / mx_gib:.2f}" if ours and "memory" in ours and mx_gib else ""
            pinned, pinned_ratio = maxtext_pinned_cell(results.get((key, attention, MAXTEXT_PINNED)), ours)
            lines.append(f"| {label} | {name} | {ours_text} | {detail} | {seconds} | {comms} | {mx} | {ratio} "
                         f"| {pinned} | {pinned_ratio} | {py312_cell(results.get((key, attention, PY312)))} |")
    return "\n".join(lines)


def maxtext_pinned_cell(theirs: dict | None, ours: dict | None) -> tuple[str, str]:
    """MaxText's cell compiled with maxtrain's libtpu, and maxtrain's ratio to it."""
    if not theirs:
        return "", ""
    if "total_gb" not in theirs:
        error = theirs.get("error", "")
        if "debug_locations" in error:  # jax 0.12's Mosaic custom call carries a field libtpu 0.0.42.1 cannot read
            return "its kernel's Mosaic call does not load in this libtpu", ""
        return "fails: " + error.split(": ", 1)[-1][:80].replace("|", "/"), ""
    ratio = f"{ours['memory']['total'] / 2**30 / theirs['total_gb']:.2f}" if ours and "memory" in ours else ""
    return f"{theirs['total_gb']:.1f} (libtpu {theirs.get('libtpu', '?')})", ratio


def py312_cell(record: dict | None) -> str:
    """The cell compiled with the Python 3.12 extras: its total and the compiler that counted it."""
    if not record:
        return ""
    versions = record.get("versions") or {}
    compiler = (f"libtpu {versions.get('libtpu')}" if record.get("platform") == "tpu"
                else f"CUDA 12 plugin {versions.get('jax-cuda12-plugin')}")
    return cell_text(record) + (f", jax {versions.get('jax')}, {compiler}" if "memory" in record and versions else "")


def same_compiler_table(results: dict) -> str:
    """maxtrain's TPU cells compiled with MaxText's own jax and libtpu, against MaxText's cells."""
    lines = ["| model, sequence, target | attention | maxtrain GiB/chip | args / temps / outputs | compiled with "
             "| MaxText 0.2.5 GiB | ratio |", "|---|---|---|---|---|---|---|"]
    for key, (label, *_rest) in ROWS.items():
        for attention in ATTENTIONS:
            ours = results.get((key, attention, SAME_COMPILER))
            if ours is None:
                continue
            theirs = results.get((key, attention, "maxtext")) or {}
            detail, ratio = "", ""
            if "memory" in ours:
                mem = ours["memory"]
                versions = ours.get("versions", {})
                detail = f"{gib(mem['arguments'])} / {gib(mem['temporaries'])} / {gib(mem['outputs'])}"
                label_versions = f"jax {versions.get('jax')}, libtpu {versions.get('libtpu')}" if versions else ""
                if "total_gb" in theirs:
                    ratio = f"{mem['total'] / 2**30 / theirs['total_gb']:.2f}"
            else:
                label_versions = ""
            mx = f"{theirs['total_gb']:.1f}" if "total_gb" in theirs else "not run"
            lines.append(f"| {label} | {ours.get('attention', attention)} | {cell_text(ours)} | {detail} | {label_versions} "
                         f"| {mx} | {ratio} |")
    return "\n".join(lines)


def write_doc(results: dict) -> None:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise errors.ToolError(f"{DOC} has no table markers ({BEGIN} ... {END}); put them back where the table goes")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + "\n" + table(results) + "\n" + END + tail)
    if any(who == SAME_COMPILER for (_, _, who) in results):
        with open(DOC, encoding="utf-8") as f:
            text = f.read()
        if SAME_BEGIN not in text or SAME_END not in text:
            raise errors.ToolError(f"{DOC} has no same-compiler table markers ({SAME_BEGIN} ... {SAME_END}); put them "
                                   "back where the table goes")
        head, rest = text.split(SAME_BEGIN, 1)
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(head + SAME_BEGIN + "\n" + same_compiler_table(results) + "\n" + SAME_END + rest.split(SAME_END, 1)[1])


def run(args) -> None:
    """Compile every selected cell not yet in args.results (each appended to it as it finishes), then write the
    tables into docs/scale.md."""
    results = load_results(args.results)
    maxtext_dir = os.path.join("/tmp", "scale_maxtext")
    whos = ["maxtrain"] if not (args.only_maxtext or args.only_same_compiler or args.only_py312) else []
    if args.maxtext_python and not args.only_same_compiler:
        whos.append("maxtext")
    if args.maxtext_python and args.maxtext_pinned_libtpu:
        whos.append(MAXTEXT_PINNED)
    if args.same_compiler_python and not args.only_maxtext:
        whos.append(SAME_COMPILER)
    if args.py312_python:
        whos.append(PY312)
    if not args.table_only:
        for key in args.rows:
            for attention in args.attention:
                for who in whos:
                    if who not in ("maxtrain", PY312) and ROWS[key][2] is None:
                        continue  # a GPU row: MaxText's compiler and libtpu have nothing to say
                    if (key, attention, who) in results and not args.redo:
                        continue
                    started = time.time()
                    load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
                    print(f"{who}: {key} attention={attention} ...", flush=True)
                    if who == "maxtext":
                        record = run_maxtext(args.maxtext_python, key, attention, maxtext_dir)
                    elif who == MAXTEXT_PINNED:
                        path, version = pinned_libtpu_path(maxtext_dir)
                        record = run_maxtext(args.maxtext_python, key, attention, maxtext_dir, libtpu_path=path)
                        record["libtpu"] = version
                    else:
                        python = {"maxtrain": sys.executable, PY312: args.py312_python}.get(who, args.same_compiler_python)
                        record = run_cell(python, key, attention)
                    record.update(row=key, attention=attention, who=who, wall_seconds=round(time.time() - started, 1),
                                  date=datetime.date.today().isoformat(), machine=platform.node(), load_at_start=load)
                    with open(args.results, "a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")
                    results[(key, attention, who)] = record
                    print("   ", record.get("total_gb", record.get("error")) if who.startswith("maxtext") else cell_text(record),
                          flush=True)
    write_doc(results)
    print(f"wrote {DOC}")

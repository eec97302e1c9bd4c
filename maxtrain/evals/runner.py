"""TaskEvaluator: set up once per run, then score every task in one pass whenever asked.

    evaluator = TaskEvaluator(config, tokenizer, mesh, rt, log=log)   # checks data, tokenizes, packs
    results = evaluator.evaluate(params)                              # collective: every process calls it
    evaluator.report(step, results, writer)                           # stdout, JSONL, TensorBoard, JSON

Set-up (before any training step): the cache is checked against its manifest, every task's
examples are built on every process, and process p takes examples p, p + P, p + 2P, ... of the
concatenated list (so each example's choices stay together, and together the processes cover every
example exactly once). It tokenizes only its own requests and packs them, across tasks, into rows of
`eval_tasks_max_target_length` tokens. Each evaluation then scores the rows and shares the
per-request log-likelihoods between processes, so that every process computes the same metrics.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax

from maxtrain import config as config_lib
from maxtrain.config import checks as config_checks
from maxtrain.data import hosts
from maxtrain.evals import data as data_lib
from maxtrain.evals import task_metrics
from maxtrain.evals import requests as requests_lib
from maxtrain.evals import scoring
from maxtrain.evals import tasks as tasks_lib

RESULTS_FILE = "eval_tasks.json"


def settings(config) -> dict:
    """The resolved evaluation settings: tasks with their few-shot counts, row length, rows per device."""
    return {"tasks": config_checks.parse_eval_tasks(config.eval_tasks, config.eval_tasks_num_fewshot),
            "max_examples": config.eval_tasks_max_examples,
            "length": config.eval_tasks_max_target_length if config.eval_tasks_max_target_length > 0
            else config.max_target_length,
            "rows_per_device": config.eval_tasks_per_device_batch_size if config.eval_tasks_per_device_batch_size > 0
            else config.per_device_batch_size}


class TaskEvaluator:
    def __init__(self, config, tokenizer, mesh, rt, log=print):
        if tokenizer is None:  # only where tokenizer_path is unset: data.make_inputs loads a set one
            raise config_lib.ConfigError(f"eval_tasks needs the model's tokenizer, and dataset_type="
                                         f"{config.dataset_type} has none of its own; set tokenizer_path=<the "
                                         "tokenizer the model is trained with>")
        started = time.time()
        self.config, self.mesh, self.rt, self.log = config, mesh, rt, log
        self.settings = settings(config)
        self.tasks = self.settings["tasks"]
        self.cache_dir = data_lib.cache_dir_for(config)
        files = data_lib.open_cache(self.cache_dir, self.tasks)
        self.examples = []
        for task, shots in self.tasks.items():
            self.examples += tasks_lib.load_examples(task, files[task], shots, self.settings["max_examples"])
        index, count = jax.process_index(), jax.process_count()
        self.mine = self.examples[index::count]
        self.request_counts = [sum(len(e.requests) for e in self.examples[p::count]) for p in range(count)]
        tokenized = requests_lib.tokenize([r for e in self.mine for r in e.requests], tokenizer)
        self.packed = requests_lib.pack(tokenized, self.settings["length"], f"eval_tasks on process {index}")
        self.rows_per_batch = hosts.batch_rows(self.settings["rows_per_device"], jax.local_device_count())  # a fraction
        local_batches = math.ceil(self.packed.num_rows / self.rows_per_batch)
        self.num_batches = max(hosts.agree(local_batches, count))
        self.step_fn = scoring.make_score_step(config, rt, mesh)
        self.history: dict[str, dict] = self._previous_results()
        tokens = int((self.packed.segment_ids > 0).sum())
        log(f"eval_tasks: {', '.join(f'{t}' + (f' ({s}-shot)' if s else '') for t, s in self.tasks.items())}: "
            f"{len(self.examples):,} examples, {sum(self.request_counts):,} requests (per process "
            f"{self.request_counts}); this process "
            f"{sum(len(e.requests) for e in self.mine):,} requests, {tokens:,} tokens in {self.packed.num_rows:,} "
            f"rows of {self.settings['length']} ({100 * tokens / max(self.packed.inputs.size, 1):.0f}% filled), "
            f"{self.num_batches} batches of {self.rows_per_batch} rows; "
            f"{self.packed.truncated} requests truncated on the left; ready in {time.time() - started:.1f}s")

    def due(self, step: int, is_last: bool) -> bool:
        interval = self.config.eval_tasks_interval
        return is_last or (interval > 0 and step % interval == 0)

    def evaluate(self, params) -> dict:
        """{task: metrics} over every process' examples (call on every process with the same params)."""
        started = time.time()
        logprobs, greedy = scoring.score_rows(self.step_fn, params, self.packed, self.rows_per_batch,
                                              self.num_batches, self.mesh, self.config.logical_axis_rules)
        ll, is_greedy = requests_lib.request_scores(self.packed, logprobs, greedy)
        gathered = scoring.all_gather_requests(ll, is_greedy, self.request_counts)
        count = len(gathered)
        per_example = [None] * len(self.examples)
        for p, (p_ll, p_greedy) in enumerate(gathered):
            shard = self.examples[p::count]
            for i, result in zip(range(p, len(self.examples), count),
                                 task_metrics.example_results(shard, p_ll, p_greedy)):
                per_example[i] = result
        results = {}
        for task in self.tasks:
            task_results = [r for e, r in zip(self.examples, per_example) if e.task == task]
            results[task] = task_metrics.task_metrics(task, task_results)
            results[task]["samples"] = task_results
        results["seconds"] = time.time() - started
        return results

    def report(self, step: int, results: dict, writer=None) -> None:
        """Prints one line per task, writes `eval_tasks/<task>/<metric>` to the metric writer (JSONL,
        TensorBoard and whatever else it writes to), updates <run>/eval_tasks.json and, with
        eval_tasks_log_samples, each example's scores. Only process 0 writes."""
        summary = {t: {k: v for k, v in m.items() if k != "samples"} for t, m in results.items() if t in self.tasks}
        scalars = {"eval_tasks/seconds": results["seconds"]}
        for task, m in summary.items():
            scalars.update(task_metrics.scalars(task, m))
        if jax.process_index() != 0:
            return
        for task, m in summary.items():
            figures = "  ".join(f"{k} {v:.4f}" for k, v in m.items()
                                if isinstance(v, float) and not k.endswith("_stderr"))
            self.log(f"eval_tasks at step {step}: {task} ({m['num_examples']} examples)  {figures}")
        self.log(f"eval_tasks at step {step}: scored in {results['seconds']:.1f}s")
        if writer is not None:
            writer.write(step, scalars, print_line=False)
        self.history[str(step)] = summary
        self._write_json()
        if self.config.eval_tasks_log_samples:
            directory = os.path.join(self.config.run_dir, "eval_tasks", f"step_{step}")
            os.makedirs(directory, exist_ok=True)
            for task in self.tasks:
                with open(os.path.join(directory, f"{task}.jsonl"), "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(r) + "\n" for r in results[task]["samples"])

    def run(self, params, step: int, writer=None) -> dict:
        results = self.evaluate(params)
        self.report(step, results, writer)
        return results

    # ----------------------------------------------------------------------------------------

    def _results_path(self) -> str:
        return os.path.join(self.config.run_dir, RESULTS_FILE)

    def _previous_results(self) -> dict:
        """A resumed run keeps the results of the evaluations before its restart."""
        try:
            with open(self._results_path(), encoding="utf-8") as f:
                return json.load(f).get("results", {})
        except (OSError, ValueError):
            return {}

    def _write_json(self) -> None:
        steps = sorted(self.history, key=int)
        out = {"model_name": self.config.model_name, "load_parameters_path": self.config.load_parameters_path,
               "tokenizer": self.config.tokenizer_path, "settings": {**self.settings, "cache_dir": self.cache_dir},
               "results": {s: self.history[s] for s in steps},
               "final": {"step": int(steps[-1]), **self.history[steps[-1]]} if steps else None}
        os.makedirs(self.config.run_dir, exist_ok=True)
        path = self._results_path()
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".tmp", path)


def from_config(config, tokenizer, mesh, rt, log=print) -> TaskEvaluator | None:
    """The run's evaluator, or None when eval_tasks is empty."""
    if not config.eval_tasks.strip():
        return None
    return TaskEvaluator(config, tokenizer, mesh, rt, log)

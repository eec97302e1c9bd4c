"""Time downstream evaluation on a model with random weights: set-up (data check, tokenization,
packing), compiling the scoring step, and scoring.

    python scripts/benchmark_eval_tasks.py configs/base.yml eval_tasks=hellaswag eval_tasks_max_examples=1000 \\
        eval_tasks_max_target_length=256 [model_name=llama3-1b ...] [--repeats 1] [--max-batches K]

The tokenizer is the run's (tokenizer_path, or the default corpus' for dataset_type=default); the
model is initialized from `seed`, so the scores mean nothing; the times are what scoring that shape
costs. The step is compiled first (on the first batch, timed on its own); then the rows are scored
`--repeats` times. `--max-batches K` scores only the first K of the packed batches (every batch has
the same shape and the rows are ~all full, so time per batch x batches is the whole evaluation's
time); the line then says what it projects for all of them. `--init-per-leaf` draws the weights one
array at a time, so that a 1B shape fits in little more than its own float32 weights. Prints one line of figures, with wall
and CPU seconds (this process, all threads: on a shared machine CPU time varies less than wall
time), the load average before and after, and the command.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  pylint: disable=wrong-import-position

from maxtrain import config as config_lib  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain import decode, evals  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.errors import run_cli  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.parallel import sharding  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.data import hosts  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.evals import scoring  # noqa: E402  pylint: disable=wrong-import-position


def load_average() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Timer:
    def __enter__(self):
        self.wall, self.cpu = time.time(), cpu_seconds()
        return self

    def __exit__(self, *_):
        self.wall, self.cpu = time.time() - self.wall, cpu_seconds() - self.cpu


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="benchmark_eval_tasks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="scorings after the compilation (the best is shown)")
    parser.add_argument("--init-per-leaf", action="store_true",
                        help="draw each weight array N(0, 0.02) on its own (the model's init in one jit needed "
                             "~12 GB for a 1B shape; the values do not change the time)")
    parser.add_argument("--max-batches", type=int, default=0, help="score only the first K batches (0 = all)")
    args, overrides = parser.parse_known_args(argv)
    load_before = load_average()
    config = config_lib.with_devices(config_lib.load_config(overrides), jax.device_count())
    mesh, rt = sharding.create_mesh(config), Runtime.from_config(config)
    with Timer() as setup:
        evaluator = evals.TaskEvaluator(config, decode.tokenizer_for(config, log=lambda *_: None), mesh, rt,
                                        log=lambda *_: None)
    shardings = jax.tree.map(lambda s: sharding.named_sharding(mesh, s.axes, config.logical_axis_rules),
                             Model.bind(config).param_specs, is_leaf=is_spec)
    key = jax.random.key(config.seed)
    if args.init_per_leaf:  # peak memory: the params and one leaf, not the whole init's temporaries twice over
        shapes = jax.eval_shape(lambda k: Model.bind(config).init_params(k), key)
        leaves, treedef = jax.tree.flatten(shapes)
        params = jax.tree.unflatten(treedef, [
            jax.jit(lambda k, leaf=leaf: 0.02 * jax.random.normal(k, leaf.shape, leaf.dtype), out_shardings=s)(
                jax.random.fold_in(key, i)) for i, (leaf, s) in enumerate(zip(leaves, jax.tree.leaves(shardings)))])
    else:
        params = jax.jit(lambda k: Model.bind(config).init_params(k), out_shardings=shardings)(key)
    packed, rules = evaluator.packed, config.logical_axis_rules
    batches = evaluator.num_batches if args.max_batches <= 0 else min(args.max_batches, evaluator.num_batches)
    with sharding.activation_sharding(mesh, rules):
        first = next(packed.batches(evaluator.rows_per_batch, 1))
        with Timer() as compiling:  # compiles, and scores one batch
            jax.block_until_ready(evaluator.step_fn(params, hosts.to_global(first, mesh, rules, scoring.BATCH_AXES)))
        runs = []
        for _ in range(max(args.repeats, 1)):
            with Timer() as run:
                if batches == evaluator.num_batches:
                    evaluator.evaluate(params)  # the whole evaluation, as in training
                else:
                    scoring.score_rows(evaluator.step_fn, params, packed, evaluator.rows_per_batch, batches, mesh,
                                       rules)
            runs.append(run)
    best = min(runs, key=lambda r: r.wall)
    tokens = int((packed.segment_ids > 0).sum())
    scored_rows = min(batches * evaluator.rows_per_batch, packed.num_rows)
    scored_tokens = int((packed.segment_ids[:scored_rows] > 0).sum())
    line = (f"examples {len(evaluator.examples)}  requests {sum(evaluator.request_counts)}  tokens {tokens:,}  rows "
            f"{packed.num_rows} x {evaluator.settings['length']} in {evaluator.num_batches} batches of "
            f"{evaluator.rows_per_batch}  params {Model.bind(config).num_params / 1e6:.1f}M  devices {jax.device_count()}  "
            f"set-up {setup.wall:.1f}s  compile+1 batch {compiling.wall:.1f}s  ")
    if batches == evaluator.num_batches:
        line += (f"scoring {best.wall:.1f}s wall, {best.cpu:.1f}s CPU ({tokens / best.wall:,.0f} tokens/s)  ")
    else:
        per_batch = best.wall / batches
        line += (f"first {batches} batches ({scored_tokens:,} tokens) {best.wall:.1f}s wall, {best.cpu:.1f}s CPU "
                 f"({scored_tokens / best.wall:,.0f} tokens/s; all {evaluator.num_batches} batches at that rate: "
                 f"{per_batch * evaluator.num_batches:,.0f}s wall, {best.cpu / batches * evaluator.num_batches:,.0f}s "
                 "CPU)  ")
    print(line + f"load average {load_before} -> {load_average()}")
    print("command: python scripts/benchmark_eval_tasks.py " + " ".join(argv))


if __name__ == "__main__":
    run_cli("benchmark_eval_tasks", main)

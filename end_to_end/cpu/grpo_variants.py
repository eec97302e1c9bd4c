"""The GRPO variants side by side on the arithmetic task of end_to_end/cpu/grpo.py: held-out accuracy after the same
number of prompts, several seeds each.

    python end_to_end/cpu/grpo_variants.py [--variants grpo,dr_grpo,dapo,gspo,cispo] [--seeds 0,1,2]
                                           [--steps 160] [--prompts 32] [--generations 16] [--reuse-sft]

1. The data, tokenizer and SFT warm-up of end_to_end/cpu/grpo.py (the same files and settings; `--reuse-sft`
   keeps an SFT model this script made before in $E2E_OUT/grpo_variants).
2. For every variant and seed, GRPO from that SFT model: --prompts x --generations completions per rollout at
   temperature 1, the exact-match reward, learning rate 1e-4 (10% warm-up, then constant), --steps optimizer steps
   with every rollout batch split into two mini-batches (grpo_steps_per_generation=2: the second update of each
   rollout is off policy, so that the variants' clipping and importance weights act). `seed` sets the rollouts' and
   the data order's randomness (the SFT model is the same for all). The variants, each with its paper's settings:

       grpo     loss per sequence, then averaged (grpo_loss_type=grpo), group std, eps 0.2, KL 0.04 (DeepSeekMath)
       dr_grpo  no std scaling, no length normalisation (grpo_loss_type=dr_grpo, grpo_scale_rewards=none), no KL
       dapo     token-level loss, clip-higher 0.28, dynamic sampling, no KL (DAPO)
       gspo     sequence-level importance ratio, clip 3e-4 / 4e-4, no KL (GSPO, Qwen3)
       cispo    clipped stop-gradient importance weights, eps_max 5, no KL (MiniMax-M1; ScaleRL's eps_max)

3. Prints a table: per variant, the held-out greedy accuracy of the SFT model and after training, mean and
   per seed, with the binomial standard error of one run, and the wall time per run. No verdict on which is
   better: on this task and budget the spread between seeds says how far apart two variants must be to differ.

PASS when every run finished and each variant's mean accuracy is above the SFT model's (each learned something).
Measured figures: docs/post_training.md, "GRPO variants: learning on the arithmetic task".
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

VARIANTS = {
    "grpo": ["grpo_loss_type=grpo", "grpo_beta=0.04", "grpo_epsilon=0.2"],
    "dr_grpo": ["grpo_loss_type=dr_grpo", "grpo_scale_rewards=none", "grpo_beta=0", "grpo_epsilon=0.2"],
    "dapo": ["grpo_loss_type=dapo", "grpo_beta=0", "grpo_epsilon=0.2", "grpo_epsilon_high=0.28",
             "grpo_dynamic_sampling=true"],
    "gspo": ["grpo_loss_type=grpo", "grpo_importance_sampling_level=sequence", "grpo_beta=0", "grpo_epsilon=3e-4",
             "grpo_epsilon_high=4e-4"],
    "cispo": ["grpo_loss_type=cispo", "grpo_beta=0", "grpo_epsilon_high=5.0"],
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo_variants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one GRPO run per variant and seed")
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps (as end_to_end/cpu/grpo.py)")
    parser.add_argument("--steps", type=int, default=160, help="GRPO optimizer steps per run (two per rollout)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    parser.add_argument("--generations", type=int, default=16, help="completions per prompt (num_generations)")
    parser.add_argument("--held-out", type=int, default=500, help="held-out sums for the accuracy")
    parser.add_argument("--lr", type=float, default=1e-4, help="GRPO's learning rate")
    parser.add_argument("--reuse-sft", action="store_true", help="keep the SFT model in $E2E_OUT/grpo_variants")
    options = parser.parse_args(argv)
    variants = [v for v in options.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        seeds = [int(s) for s in options.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds {options.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    for name in ("sft_steps", "steps", "prompts", "generations", "held_out"):
        common.positive(parser, "--" + name.replace("_", "-"), getattr(options, name))
    if options.steps % 2:
        parser.error(f"--steps {options.steps}: each rollout makes two optimizer steps; give an even number")
    if options.prompts % 2:
        parser.error(f"--prompts {options.prompts}: each rollout is split into two mini-batches; give an even number")

    if options.reuse_sft:
        out = Path(os.environ.get("E2E_OUT", common.ROOT / "outputs" / "end_to_end")).resolve() / "grpo_variants"
    else:
        out = common.out_dir("grpo_variants")
    with common.errors.user_paths():
        data = grpo_e2e.make_data(out, 10_000 - options.held_out, options.held_out, keep_tokenizer=options.reuse_sft)
    base = [*grpo_e2e.MODEL, f"base_output_directory={out}", f"tokenizer_path={data['tokenizer']}"]
    if options.reuse_sft and (out / "sft" / "checkpoints").is_dir():
        print(f"reusing the SFT model in {out / 'sft'}", flush=True)
    else:
        common.run("maxtrain.train", compose(
            *base, "run_name=sft", "objective=sft", "train_data_columns=[prompt,completion]",
            f"grain_train_files={data['sft']}", "eval_interval=-1", "per_device_batch_size=32", "max_target_length=96",
            f"steps={options.sft_steps}", "learning_rate=3e-3", "warmup_steps_fraction=0.05"), out / "sft.log")

    results: dict[str, list[tuple[int, float, float, float]]] = {}
    for variant in variants:
        for seed in seeds:
            run = f"{variant}_seed{seed}"
            metrics_file = out / f"{run}_metrics.jsonl"
            metrics_file.unlink(missing_ok=True)
            shutil.rmtree(out / run, ignore_errors=True)  # a fresh run, never a resume of an earlier one's checkpoints
            started = time.perf_counter()
            common.run("maxtrain.train", compose(
                *base, f"run_name={run}", "objective=grpo", "train_data_columns=[prompt,answer]",
                "eval_data_columns=[prompt,answer]", f"grain_train_files={data['grpo']}",
                f"grain_eval_files={data['held_out']}", "eval_steps=-1", f"eval_interval={options.steps}",
                f"load_parameters_path={out / 'sft'}", f"seed={seed}",
                f"per_device_batch_size={options.generations * options.prompts // 2}",
                f"num_generations={options.generations}", "grpo_steps_per_generation=2",
                "max_prefill_predict_length=16", "decode_sampling_strategy=weighted", "decode_sampling_temperature=1.0",
                *VARIANTS[variant], f"learning_rate={options.lr:g}", "warmup_steps_fraction=0.1",
                "lr_schedule_type=constant", f"steps={options.steps}", f"metrics_file={metrics_file}"),
                out / f"{run}.log")
            seconds = time.perf_counter() - started
            accuracy = {m["step"]: m["eval/grpo_accuracy"] for m in common.metrics(metrics_file)
                        if "eval/grpo_accuracy" in m}
            results.setdefault(variant, []).append((seed, accuracy[min(accuracy)], accuracy[max(accuracy)], seconds))
            print(f"{run}: held-out accuracy {accuracy[min(accuracy)]:.3f} -> {accuracy[max(accuracy)]:.3f} "
                  f"({seconds:.0f} s)", flush=True)

    n = options.held_out
    print(f"\nheld-out greedy accuracy on {n} sums after {options.steps} optimizer steps "
          f"({options.steps // 2 * options.prompts} prompts x {options.generations} completions); one run's "
          "binomial standard error is about ± 0.02")
    print("| variant | SFT model | after GRPO, mean of seeds | per seed | seconds per run |")
    print("| --- | --- | --- | --- | --- |")
    ok = True
    for variant, rows in results.items():
        sft = rows[0][1]
        finals = [r[2] for r in rows]
        mean = statistics.mean(finals)
        spread = f" ± {statistics.stdev(finals):.3f}" if len(finals) > 1 else ""
        print(f"| {variant} | {sft:.3f} | {mean:.3f}{spread} | "
              + ", ".join(f"{r[2]:.3f} (seed {r[0]})" for r in rows)
              + f" | {statistics.mean(r[3] for r in rows):.0f} |")
        ok = ok and mean > sft
    return common.verdict("grpo_variants", ok, "every variant's mean held-out accuracy above the SFT model's"
                          if ok else "a variant's mean held-out accuracy did not rise above the SFT model's")


if __name__ == "__main__":
    common.main("grpo_variants", main)

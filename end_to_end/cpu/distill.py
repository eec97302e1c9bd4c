"""Distillation end to end on CPU: a small student distilled from a larger teacher learns more in the
same steps than the same student trained on the data alone.

    python end_to_end/cpu/distill.py [--teacher-steps 120] [--steps 100] [--alpha 0.5] [--temperature 1.0]
    python end_to_end/cpu/distill.py --memory    # only the compiled memory of the student's step, alone and distilled

Every run takes 8 sequences of 256 tokens a step (half the default batch, to fit ~10 minutes on a
busy 2-core CPU).
1. Trains the teacher: the default model (4 layers, D 256) on the default corpus for --teacher-steps
   steps.
2. Trains the student (2 layers, D 128, 2 heads of 64) on the same data for --steps steps twice, from
   the same initialization and batches: on the data alone (the next-token loss), and distilled from
   the teacher (objective=distill, distill_alpha, distill_temperature).
3. Prints both students' eval curves: the next-token eval loss (the lm run's eval loss, the distilled
   run's distill_ce), measured on the same eval batches every 25 steps.

PASS when the distilled student's final next-token eval loss is below the other's (measured with the
defaults on the 2-core CPU: docs/post_training.md, "Distillation").

--memory compiles the student's train step (no training, no teacher checkpoint: the default model's
settings stand in for it) with num_vocab_tiling 1 and 4, on the data alone and distilled, and prints
XLA's memory analysis: the teacher adds its params to the arguments and no optimizer state or
gradients. Its verdict: PASS when distillation adds exactly the teacher's params to the arguments.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain import config as config_lib  # noqa: E402  pylint: disable=wrong-import-position

from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.training import builder, distillation  # noqa: E402  pylint: disable=wrong-import-position

COMMON = ["per_device_batch_size=8", "enable_tensorboard=false", "viz_period=-1", "max_new_tokens=0", "eval_interval=25"]
STUDENT = ["base_num_decoder_layers=2", "base_emb_dim=128", "base_num_query_heads=2", "base_num_kv_heads=2",
           "head_dim=64", "base_mlp_dim=384", "enable_checkpointing=false"]


def curve(metrics: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in common.metrics(metrics) if key in m}


def cost(log: str) -> str:
    """The run's compiled memory line and its median step time, from its log."""
    memory = re.search(r"memory per device: .*", log)
    times = sorted(float(t) for t in re.findall(r"step_time ([0-9.]+)s", log)[1:])
    median = f"{times[len(times) // 2]:.3f} s/step (median of the logged steps after the first)" if times else "?"
    return f"{median}; {memory.group(0) if memory else 'no memory line'}"


def memory() -> int:
    """The compiled memory of the student's step, alone and distilled, untiled and tiled."""
    base = ["configs/base.yml", *COMMON[:1]]
    teacher = config_lib.load_config(base)
    teacher_bytes = Model.bind(teacher).num_params * 4
    extra = {}
    print("num_vocab_tiling  run         arguments MiB  temporaries MiB  outputs MiB")
    for tiles in (1, 4):
        for distilled in (False, True):
            config = config_lib.load_config([*base, *STUDENT, f"num_vocab_tiling={tiles}"] + (
                ["objective=distill", "distill_teacher_path=none"] if distilled else []))
            if distilled:  # the teacher's settings, as adopt_teacher records them from its checkpoint
                config = config_lib.Config({**config.to_dict(),
                                            distillation.KEY: {k: getattr(teacher, k) for k in model_keys.MODEL_KEYS}})
            m = builder.build(config).compile().memory_analysis()
            extra[distilled] = m.argument_size_in_bytes
            print(f"{tiles:16d}  {'distilled' if distilled else 'data alone':10s}  {m.argument_size_in_bytes / 2**20:13.2f}  "
                  f"{m.temp_size_in_bytes / 2**20:15.2f}  {m.output_size_in_bytes / 2**20:11.2f}", flush=True)
    added = extra[True] - extra[False]
    return common.verdict("distill-memory", added == teacher_bytes, f"distillation adds {added / 2**20:.2f} MiB of "
                          f"arguments; the teacher's params are {teacher_bytes / 2**20:.2f} MiB")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher-steps", type=int, default=120)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--memory", action="store_true", help="only the compiled memory of the student's step")
    args = parser.parse_args(argv)
    if args.memory:
        return memory()
    common.positive(parser, "--teacher-steps", args.teacher_steps)
    common.positive(parser, "--steps", args.steps)
    out = common.out_dir("distill")

    teacher = ["run_name=teacher", f"steps={args.teacher_steps}", f"checkpoint_period={args.teacher_steps}"]
    common.run("maxtrain.train", [f"base_output_directory={out}", *COMMON, *teacher,
                                  f"metrics_file={out}/teacher.jsonl"], out / "teacher.log")
    student = [f"base_output_directory={out}", *COMMON, *STUDENT, f"steps={args.steps}"]
    alone_log = common.run("maxtrain.train", [*student, "run_name=alone", f"metrics_file={out}/alone.jsonl"],
                           out / "alone.log")
    distilled_log = common.run("maxtrain.train", [
        *student, "run_name=distilled", f"metrics_file={out}/distilled.jsonl", "objective=distill",
        f"distill_teacher_path={out}/teacher", f"distill_alpha={args.alpha}", f"distill_temperature={args.temperature}"],
        out / "distilled.log")

    teacher_curve = curve(out / "teacher.jsonl", "eval/avg_loss")
    alone = curve(out / "alone.jsonl", "eval/avg_loss")
    distilled = curve(out / "distilled.jsonl", "eval/distill_ce")
    kl = curve(out / "distilled.jsonl", "eval/distill_kl")
    print(f"teacher eval loss: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(teacher_curve.items()))}")
    print("student next-token eval loss by step:\n  step   data alone   distilled   (distilled: KL to the teacher)")
    for step in sorted(alone):
        print(f"  {step:4d}   {alone[step]:10.4f}   {distilled.get(step, float('nan')):9.4f}   "
              f"({kl.get(step, float('nan')):.4f})")
    print(f"cost: data alone {cost(alone_log)}\n      distilled  {cost(distilled_log)}", flush=True)
    last_alone, last_distilled = alone.get(args.steps), distilled.get(args.steps)
    if last_alone is None or last_distilled is None:
        return common.verdict("distill", False, f"no eval loss at step {args.steps}")
    return common.verdict("distill", last_distilled < last_alone,
                          f"student eval loss at step {args.steps}: distilled {last_distilled:.4f}, "
                          f"data alone {last_alone:.4f} (teacher {teacher_curve.get(args.teacher_steps, float('nan')):.4f})")


if __name__ == "__main__":
    common.main("distill", main)

"""Long context on this CPU: a tiny model trained at 64k tokens a sequence with ring context parallelism 4,
its losses against context parallelism 1.

    python end_to_end/cpu/long_context.py                       # 65,536 tokens a row, 3 steps each run
    python end_to_end/cpu/long_context.py --length 4096 --steps 5   # shorter

Runs `python -m maxtrain.train configs/base.yml` twice on 4 simulated CPU devices with the same tiny model
(1 layer, D 64, one query head of 16, vocabulary 512), the embedded corpus packed into rows of --length tokens
(concat_then_split: documents back to back with segment ids and positions restarting per document, a long one
carried over to the next row), the same seed and the same 4 rows a step:

    cp1    ici_fsdp_parallelism=4: one row per device, attention in causal chunks (models/attention)
    ring   ici_context_parallelism=4 context_parallel_strategy=ring: every row split 4 ways (dual_chunk_swap),
           keys and values passed round the ring (models/attention/ring.py)

PASS when every step's training loss of the ring run is within TOLERANCE (1e-5) relative of cp1's. Both
compute the same sums in another order (float32: the ring merges 4 key blocks with the online softmax, cp1
one softmax per query chunk; the loss is summed over other shards), so they agree to float32 rounding, not
necessarily bitwise. Prints both losses, their relative difference and each run's step times (perf/step_time_seconds of
its metrics file; compilation is printed apart in its log); docs/parallelism.md ("Long context") records a run.

Memory: at the default 65,536 tokens the compiled step needs 1.06 GiB of temporaries per device with CP 1 and
1.87 GiB with the ring (XLA's memory analysis, 4 simulated devices), which attends each key block in pieces of
1,024 queries (ring.QUERY_CHUNK; whole, [4 rows, 16,384, 16,384] float32 scores, it needed 28.17 GiB). Time is
the limit on a small CPU: the ring computes every block pair in full, masked entries included, so a step costs
about (T / 8,192)^2 times the 8,192-token one (docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

TOLERANCE = 1e-5
DEVICES = 4
TINY = ["base_num_decoder_layers=1", "base_emb_dim=64", "base_num_query_heads=1", "base_num_kv_heads=1",
        "head_dim=16", "base_mlp_dim=128", "vocab_size=512", "per_device_batch_size=1", "dtype=float32",
        "eval_interval=-1", "max_new_tokens=0", "viz_period=-1", "enable_checkpointing=false", "log_period=1",
        "default_corpus_max_mb=3"]
RUNS = {"cp1": ["ici_fsdp_parallelism=4"],
        "ring": ["ici_fsdp_parallelism=1", "ici_context_parallelism=4", "context_parallel_strategy=ring"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="long_context", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536, help="tokens a row (max_target_length), a multiple of 8")
    parser.add_argument("--steps", type=int, default=3, help="training steps of each run")
    args = parser.parse_args(argv)
    common.positive(parser, "--steps", args.steps)
    if args.length < 8 or args.length % (2 * DEVICES):
        parser.error(f"--length {args.length} must be a multiple of {2 * DEVICES} (2 chunks a device) >= 8")
    out = common.out_dir("long_context")
    losses, times = {}, {}
    for name, extra in RUNS.items():
        common.run("maxtrain.train", [*TINY, *extra, f"max_target_length={args.length}", f"steps={args.steps}",
                                      f"base_output_directory={out}", f"run_name={name}",
                                      f"dataset_cache_dir={out}/cache", f"metrics_file={out}/{name}.jsonl"],
                   out / f"{name}.log", common.env(devices=DEVICES))
        lines = common.train_losses(out / f"{name}.jsonl")
        losses[name] = {s: m["learning/loss"] for s, m in lines.items()}
        times[name] = {s: m.get("perf/step_time_seconds") for s, m in lines.items()}
    print(f"{args.length} tokens a row, {DEVICES} rows a step")
    print("step  cp1 loss     ring loss    relative diff  cp1 step s  ring step s")
    worst, steps = 0.0, sorted(losses["cp1"])
    for step in steps:
        a, b = losses["cp1"][step], losses["ring"].get(step)
        diff = abs(b - a) / abs(a) if b is not None else float("inf")
        worst = max(worst, diff)
        print(f"{step:4d}  {a:.8f}  {b if b is None else f'{b:.8f}'}  {diff:.2e}       "
              f"{_seconds(times['cp1'].get(step))}  {_seconds(times['ring'].get(step))}")
    ok = len(steps) == args.steps and worst <= TOLERANCE
    return common.verdict("long_context", ok, f"largest relative difference of the training losses {worst:.2e} "
                                              f"(tolerance {TOLERANCE:.0e}) over {len(steps)} steps at {args.length} "
                                              "tokens a row, ring context parallelism 4 against 1")


def _seconds(value) -> str:
    return "    -     " if value is None else f"{value:10.2f}"


if __name__ == "__main__":
    common.main("long_context", main)

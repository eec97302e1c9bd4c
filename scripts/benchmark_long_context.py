"""Times a training step (forward + backward) of a tiny hybrid against the same model with full attention in
every layer, at long contexts, on this machine's first device (meant for CPU).

The models: the default model's sizes (configs/models/default.yml: width 256, 4 layers, 4 heads of 64, MLP
768, vocabulary 4096) in the qwen3_5_text family (--family: qwen3_5_text, or qwen3_next with 4 experts of
384, 2 per token). "hybrid" is the
family's stack with inhomogeneous_layer_cycle_interval=4: layers 0-2 gated delta-net (--gdn-heads query/key
and value heads of 64; the chunked delta rule, models/recurrent/gated_delta.py), layer 3 gated full attention. "full"
is the same model with inhomogeneous_layer_cycle_interval=1: every layer full attention. Attention is
attention=dot_product, which on CPU is models/attention/'s causal_chunks (the causal query chunks, at
most 8, each against only the keys it can see: memory O(T^2 / 8) per head, no [T, T] array at once).
remat_policy=full, dtype float32, batch 1, one document per row.

Each (model, length) jits value_and_grad of the mean next-token loss (models.loss_fn), compiles it once
(compile time printed apart), runs --warmup untimed steps and reports the median of --steps timed steps.
A row whose step is predicted to take longer than --max-step-seconds is not run; its prediction is
printed instead, so that a run stays within minutes on a small machine. The prediction extends the same
model's last measured row by the growth its last two rows showed (t ~ T^p, p between 1 and 2; p = 2,
quadratic, after a single row). Lengths run in the order given: smallest first.

    python scripts/benchmark_long_context.py --seq 2048 8192 32768 65536 --steps 2 --warmup 0 \
        --max-step-seconds 200

On the 2-core development machine (2026-11-28, docs/models.md) the hybrid's step hung at 8,192 tokens: two
LAPACK triangular solves of the chunked delta rule each held one of XLA:CPU's two intra-op threads.

--family deepseek times DeepSeek Sparse Attention instead: configs/models/deepseek3.2-tiny.yml (width 256, 4 layers
of MLA with 4 heads, 16 experts, an indexer of 4 heads of 32). "sparse" keeps --topk keys a query
(models/families/deepseek/selected.py: the chosen keys alone, by query blocks); "full" is the same model with
index_topk at the sequence's length, where the indexer is skipped and MLA attends to every visible key (the causal
chunks above). Both route their experts with moe_dispatch=capacity: on CPU the dropless default's ragged_dot runs
dense over every expert, and its T x K x E x F temporaries (~260 KB a token here: 1.0 of 1.37 GB at 4,096 tokens)
would hide the attention's growth and keep 65,536 tokens off a 24 GB machine:

    python scripts/benchmark_long_context.py --family deepseek --variants sparse full --seq 4096 16384 65536 \
        --topk 64 --steps 2 --warmup 0 --max-step-seconds 300
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import time

import jax
import jax.numpy as jnp

from maxtrain import config as config_lib

from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.errors import run_cli
from maxtrain.observability import metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"hybrid": 4, "full": 1, "sparse": 0}  # name -> inhomogeneous_layer_cycle_interval (deepseek: none)


def sparse_config(variant: str, seq: int, topk: int):
    """deepseek3.2-tiny keeping `topk` keys a query ("sparse"), or every key ("full": index_topk = seq)."""
    overrides = ["model_name=deepseek3.2-tiny", f"index_topk={topk if variant == 'sparse' else seq}",
                 f"max_target_length={seq}", "per_device_batch_size=1", "dtype=float32", "remat_policy=full",
                 "attention=dot_product", "enable_tensorboard=false", "max_new_tokens=0", "moe_dispatch=capacity"]
    return config_lib.load_config([os.path.join(REPO, "configs", "base.yml"), *overrides])


def model_config(family: str, cycle: int, seq: int, gdn_heads: int, chunk: int):
    overrides = [f"decoder_block={family}", f"inhomogeneous_layer_cycle_interval={cycle}",
                 f"gdn_num_key_heads={gdn_heads}", f"gdn_num_value_heads={gdn_heads}", "gdn_key_head_dim=64",
                 "gdn_value_head_dim=64", f"gdn_chunk_size={chunk}", f"max_target_length={seq}",
                 "per_device_batch_size=1", "dtype=float32", "remat_policy=full", "attention=dot_product",
                 "enable_tensorboard=false", "max_new_tokens=0"]
    if family == "qwen3_next":  # a mixture of experts: 4 of width 384, 2 per token (the default MLP's 768 active)
        overrides += ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=384"]
    return config_lib.load_config([os.path.join(REPO, "configs", "base.yml"), "model_name=default", *overrides])


def step_program(cfg):
    """jit of (params, batch) -> (mean loss, grads): what a train step computes, without the optimizer."""
    rt = Runtime.from_config(cfg, backend=jax.default_backend())

    def mean_loss(params, batch):
        loss, weight, _ = Model.bind(cfg).loss_fn(params, batch, rt)
        return loss / jnp.maximum(weight, 1.0)

    return jax.jit(jax.value_and_grad(mean_loss))


def make_batch(seq: int, vocab: int) -> dict:
    tokens = jax.random.randint(jax.random.key(1), (1, seq + 1), 4, vocab)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.arange(seq)[None],
            "segment_ids": jnp.ones((1, seq), jnp.int32), "loss_weights": jnp.ones((1, seq), jnp.float32)}


def measure(cfg, seq: int, warmup: int, steps: int) -> tuple[float, float, float]:
    """(compile seconds, median step seconds, compiled temporaries in GB) of one model at one length."""
    params = Model.bind(cfg).init_params(jax.random.key(0))
    batch = make_batch(seq, cfg.vocab_size)
    start = time.perf_counter()
    compiled = step_program(cfg).lower(params, batch).compile()
    compile_seconds = time.perf_counter() - start
    temp_gb = compiled.memory_analysis().temp_size_in_bytes / 1e9
    print(f"        {seq:>7} compiled in {compile_seconds:.1f} s, temporaries {temp_gb:.2f} GB", flush=True)
    return compile_seconds, metrics.median_seconds(compiled, params, batch, warmup=warmup, iters=steps), temp_gb


def predict(measured: list, seq: int) -> float:
    """Predicted step seconds at `seq` tokens from the rows measured so far: t ~ T^p from the last one, p the
    growth of the last two (between 1 and 2), 2 after only one row; 0.0 before any."""
    if not measured:
        return 0.0
    power = 2.0
    if len(measured) > 1:
        (t0, s0), (t1, s1) = measured[-2:]
        power = min(2.0, max(1.0, math.log(s1 / s0) / math.log(t1 / t0)))
    return measured[-1][1] * (seq / measured[-1][0]) ** power


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="benchmark_long_context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768, 65536],
                        help="tokens per sequence (batch 1), in increasing order")
    parser.add_argument("--family", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3_next", "deepseek"])
    parser.add_argument("--topk", type=int, default=64, help="deepseek: the keys each query keeps (sparse)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        help="hybrid full (the default) for the gated delta-net families, sparse full for deepseek")
    parser.add_argument("--gdn-heads", type=int, default=4, help="gated delta-net query/key and value heads")
    parser.add_argument("--chunk", type=int, default=64, help="gdn_chunk_size: tokens per chunk of the delta rule")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    parser.add_argument("--max-step-seconds", type=float, default=120.0,
                        help="skip a row whose predicted step time exceeds this (0: run every row)")
    args = parser.parse_args(argv)
    for flag, value in {"--seq": min(args.seq), "--gdn-heads": args.gdn_heads, "--chunk": args.chunk,
                        "--steps": args.steps}.items():
        if value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    if min(args.seq) < 2:
        parser.error(f"--seq {min(args.seq)} must be >= 2 (a next-token loss needs two tokens)")
    if args.warmup < 0 or args.max_step_seconds < 0:
        parser.error("--warmup and --max-step-seconds must be >= 0")
    allowed = ["sparse", "full"] if args.family == "deepseek" else ["hybrid", "full"]
    args.variants = args.variants or allowed
    if not set(args.variants) <= set(allowed):
        parser.error(f"--variants {' '.join(args.variants)}: --family {args.family} has {' and '.join(allowed)}")
    if args.family == "deepseek" and not 1 <= args.topk < min(args.seq):
        parser.error(f"--topk {args.topk} must be >= 1 and below the shortest --seq ({min(args.seq)}), where the "
                     "indexer drops keys")
    if any(later <= earlier for earlier, later in zip(args.seq, args.seq[1:])):
        parser.error(f"--seq {' '.join(map(str, args.seq))}: give the lengths in increasing order, each once "
                     "(each row's prediction comes from the one before, by the ratio of their lengths)")
    return args


def main(argv: list[str]):
    args = parse_args(argv)
    configs = {(v, s): sparse_config(v, s, args.topk) if args.family == "deepseek" else
               model_config(args.family, VARIANTS[v], s, args.gdn_heads, args.chunk)
               for v in args.variants for s in args.seq}  # every setting checked before any timing
    print(f"command: {shlex.join(['python', 'scripts/benchmark_long_context.py', *argv])}")
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; {args.family}, "
          f"{'deepseek3.2-tiny, top ' + str(args.topk) if args.family == 'deepseek' else 'default model sizes'}, "
          "float32, remat full, batch 1; "
          f"fwd+bwd median of {args.steps} after {args.warmup} warm-up")
    header = f"{'model':<7} {'tokens':>7} {'compile s':>9} {'temp GB':>7} {'step s':>9} {'ms/1k tok':>9} {'x prev':>7}"
    print(header)
    print("-" * len(header))
    for variant in args.variants:
        measured = []  # (seq, seconds) of this model's rows so far
        for seq in args.seq:
            cfg = configs[(variant, seq)]
            predicted = predict(measured, seq)
            if args.max_step_seconds and predicted > args.max_step_seconds:
                print(f"{variant:<7} {seq:>7} {'':>9} {'':>7} {'skipped':>9}  predicted ~{predicted:.0f} s "
                      f"(> --max-step-seconds {args.max_step_seconds:g})", flush=True)
                continue
            try:
                compile_s, step_s, temp_gb = measure(cfg, seq, args.warmup, args.steps)
            except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory at the largest sizes
                print(f"{variant:<7} {seq:>7}  failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}",
                      flush=True)
                continue
            ratio = f"{step_s / measured[-1][1]:>7.2f}" if measured else f"{'':>7}"
            print(f"{variant:<7} {seq:>7} {compile_s:>9.1f} {temp_gb:>7.2f} {step_s:>9.2f} "
                  f"{step_s / seq * 1e6:>9.2f} {ratio}", flush=True)
            measured.append((seq, step_s))


if __name__ == "__main__":
    run_cli("benchmark_long_context", main)

"""The selected-key attention kernel (DeepSeek-V3.2 / GLM-5's sparse attention) on one GPU: its numbers against a
float32 reference, and its speed against dense cuDNN attention at 16k and 64k tokens (issue 58's GPU row;
docs/gpu.md "Sparse attention on a GPU").

    python3 scripts/gpu_selected_check.py --out $OUT                 # on the GPU
    python scripts/gpu_selected_check.py --out /tmp/sel --dry-run    # here: tiny shapes, the kernel interpreted

What runs:
- check: bf16, one row of --check-tokens holding three packed documents and padding, 16 heads, MLA's absorbed
  shapes (latent C 512, RoPE key R 64), index_topk 1024, the keys chosen by the indexer's code
  (models/families/deepseek/selected.chosen, at full matmul precision, once). kernels/selected_attention (Triton;
  its default backward, and atomic=True's one kernel of atomic adds) and the plain-jnp gather form in bf16 (the yardstick: what bf16 alone costs) against the plain-jnp gather form in
  float32 at full matmul precision: o_c and the gradients of q_c, q_r, c and k_r (relative Frobenius error;
  tolerance kernel_check.TOLERANCE["bfloat16"]), and each head's largest kept logit (QK-clip's statistic); the
  indexer's scores from kernels/index_scores.py and from jnp at the default precision against float32 at full
  precision.
- speed, at each of --tokens (16k and 64k): forward+backward, bf16, causal, batch 1, 16 query heads (DeepSeek-V3.2's
  128 over tensor parallelism 8), index_topk 2048:
    selected kernel     the Pallas kernel over each query's chosen keys (random keys among those it sees)
    ..., atomic backward    the same with atomic=True; "selected kernel forward": the forward alone; and at the
                        first length the forward and the atomic fwd+bwd at each of --tiles
    selected plain jnp  the same keys through the gather form, 128 queries a block, checkpointed (CPU's form)
    indexer choice      selected.chosen: the indexer's scores (64 heads of 128, float32) and top_k, forward only;
                        ", fused scores": the scores from kernels/index_scores.py (no per-head scores in memory);
                        "fused scores alone": that kernel over every key, no top_k (the rest is top_k's and masks')
    dense cudnn         jax.nn.dot_product_attention(implementation="cudnn"), MLA expanded: q, k 192 wide (128 + 64),
                        v padded to 192 as the model pads it, causal, no mask
  the median of --iters after a warm-up, and TFLOP/s of the useful matmul work (the selected forms: 2 x (C + R + C)
  per kept (query, key, head), x 2.5 with the backward; dense: kernel_check.attention_flops' count at 192/128).

Prints one line per item as it runs and rewrites selected.json in --out after each; items left when --budget
seconds have passed are skipped and listed. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.errors import run_cli
from maxtrain.kernels import index_scores, selected_attention
from maxtrain.models.attention import kernel_check
from maxtrain.models.families.deepseek import indexer, selected
from maxtrain.observability import metrics

GRADS = ("o_c", "dq_c", "dq_r", "dc", "dk_r")


def gather_form(q_c, q_r, c, k_r, idx, kept, *, scale: float, dtype, chunk: int):
    """o_c [B, T, N, C] float32 over each query's chosen keys, plain jnp: per chunk of queries the chosen rows
    gathered [B, chunk, K, C + R], logits and softmax in float32; operands cast to `dtype` (float32: the reference,
    run under full matmul precision by the caller). Each chunk checkpointed, as selected.run does."""
    b, t, n, _ = q_c.shape
    q_c, q_r, c, k_r = (x.astype(dtype) for x in (q_c, q_r, c, k_r))

    def blocks(x):
        return jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(args):
        qc, qr, at, keep = args
        gather = jax.vmap(lambda rows, at: rows[at])
        c_k, r_k = gather(c, at), gather(k_r, at)
        logits = (jnp.einsum("BTNC,BTKC->BTNK", qc, c_k, preferred_element_type=jnp.float32)
                  + jnp.einsum("BTNR,BTKR->BTNK", qr, r_k, preferred_element_type=jnp.float32)) * scale
        logits = jnp.where(keep[:, :, None], logits, -jnp.inf)
        probs = jnp.where(keep[:, :, None], jax.nn.softmax(logits, axis=-1), 0.0)
        o_c = jnp.einsum("BTNK,BTKC->BTNC", probs.astype(dtype), c_k, preferred_element_type=jnp.float32)
        return o_c, jnp.max(jnp.where(keep[:, :, None], jax.lax.stop_gradient(logits), -jnp.inf), axis=(0, 1, 3))

    o_c, head_max = jax.lax.map(one, tuple(map(blocks, (q_c, q_r, idx, kept))))
    return jnp.moveaxis(o_c, 0, 1).reshape(b, t, n, -1), jnp.max(head_max, axis=0)


def fwd_bwd(fn):
    """jit of (q_c, q_r, c, k_r, idx, kept, do) -> (o_c, dq_c, dq_r, dc, dk_r, head_max)."""
    @jax.jit
    def program(q_c, q_r, c, k_r, idx, kept, do):
        (o_c, head_max), vjp = jax.vjp(lambda *x: fn(*x, idx, kept), q_c, q_r, c, k_r)
        return (o_c, *vjp((do.astype(o_c.dtype), jnp.zeros_like(head_max))), head_max)
    return program


def relative(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)) if np.all(np.isfinite(a)) else float("inf")


def packed_ids(length: int, seed: int = 0) -> np.ndarray:
    """[1, length]: three documents of random lengths, then padding (segment 0) for the last 1/16."""
    rng = np.random.default_rng(seed)
    real = length - length // 16
    cuts = np.sort(rng.choice(np.arange(real // 8, real - real // 8), size=2, replace=False))
    ids = np.zeros((1, length), np.int32)
    ids[0, :cuts[0]], ids[0, cuts[0]:cuts[1]], ids[0, cuts[1]:real] = 1, 2, 3
    return ids


def random_choice(length: int, topk: int, seed: int):
    """(idx, kept) [1, T, K]: for each query min(t + 1, K) distinct-ish random keys among 0..t (the causal edge:
    query t < K keeps keys 0..t, the rest not kept), for timing."""
    t = jnp.arange(length)[:, None]
    j = jnp.arange(topk)[None, :]
    drawn = jnp.floor(jax.random.uniform(jax.random.key(seed), (length, topk)) * (t + 1)).astype(jnp.int32)
    idx = jnp.where(t < topk, jnp.minimum(j, t), drawn)
    return idx[None], (j <= t)[None] | (t >= topk)[None]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_selected_check", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--out", required=True, help="folder for selected.json")
    parser.add_argument("--tokens", default="16384,65536", help="the speed part's lengths, comma-separated")
    parser.add_argument("--check-tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tiles", default="16x32x4,32x64x4,16x128x4,16x64x8",
                        help="heads x keys x warps variants timed at the first length (the default 16x64x4 beside)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds; later items are skipped past it")
    parser.add_argument("--dry-run", action="store_true", help="this CPU: tiny shapes, the kernel interpreted")
    args = parser.parse_args(argv)
    args.tiles = [tuple(int(v) for v in tile.split("x")) for tile in args.tiles.split(",") if tile]
    print("$ python3 scripts/gpu_selected_check.py " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)
    began = time.perf_counter()
    platform = "cpu" if args.dry_run else jax.default_backend()
    if platform != "gpu" and not args.dry_run:
        parser.error(f"needs a GPU (JAX's backend is {platform}); on a CPU pass --dry-run")
    interpret = args.dry_run
    if args.dry_run:
        n, c_w, r_w, check_topk, topk, index_heads, index_dim = 4, 32, 16, 16, 32, 2, 16
        check_tokens, lengths = 128, [256, 512]
    else:
        n, c_w, r_w, check_topk, topk, index_heads, index_dim = 16, 512, 64, 1024, 2048, 64, 128
        check_tokens, lengths = args.check_tokens, [int(x) for x in args.tokens.split(",")]
    scale = (128 + 64) ** -0.5
    os.makedirs(args.out, exist_ok=True)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "check": {}, "speed": {},
              "skipped": [], "command": "python3 scripts/gpu_selected_check.py " + " ".join(argv or sys.argv[1:])}
    ok = True

    def save():
        with open(os.path.join(args.out, "selected.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)

    def kernel(q_c, q_r, c, k_r, idx, kept, **tiles):
        return selected_attention.selected_attention(q_c, q_r, c, k_r, idx, kept, scale=scale, interpret=interpret,
                                                     with_max_logits=True, **tiles)

    def forward(**tiles):
        return jax.jit(lambda q_c, q_r, c, k_r, idx, kept, do: kernel(q_c, q_r, c, k_r, idx, kept, **tiles))

    # ---- check
    keys = jax.random.split(jax.random.key(0), 9)
    t = check_tokens
    seg = jnp.asarray(packed_ids(t))
    bf = jnp.bfloat16
    q_c = jax.random.normal(keys[0], (1, t, n, c_w), bf)
    q_r = jax.random.normal(keys[1], (1, t, n, r_w), bf)
    c = jax.random.normal(keys[2], (1, t, c_w), bf)
    k_r = jax.random.normal(keys[3], (1, t, r_w), bf)
    do = jax.random.normal(keys[4], (1, t, n, c_w), bf)
    index_q = jax.random.normal(keys[5], (1, t, index_heads, index_dim), jnp.float32)
    index_w = jax.random.normal(keys[6], (1, t, index_heads), jnp.float32)
    index_k = jax.random.normal(keys[7], (1, t, index_dim), jnp.float32)
    with jax.default_matmul_precision("highest"):
        idx, kept = jax.jit(lambda *x: selected.chosen(*x, topk=check_topk, block=selected.query_block(t)))(
            index_q, index_w, index_k, seg)
    counts = np.asarray(jnp.sum(kept, axis=-1))
    print(f"check: {t} tokens, 3 documents and padding, {n} heads, C {c_w}, R {r_w}, index_topk {check_topk}: keys "
          f"kept per query {counts.min()} to {counts.max()} (mean {counts.mean():.0f})", flush=True)
    chunk = min(t, 256)
    start = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        expected = jax.block_until_ready(fwd_bwd(
            lambda *x: gather_form(*x, scale=scale, dtype=jnp.float32, chunk=chunk))(q_c, q_r, c, k_r, idx, kept, do))
    print(f"check: the float32 reference {time.perf_counter() - start:.1f} s", flush=True)
    for name, fn in (("selected kernel bf16", kernel),
                     ("selected kernel bf16, atomic backward", lambda *x: kernel(*x, atomic=True)),
                     ("plain jnp bf16 (yardstick)", lambda *x: gather_form(*x, scale=scale, dtype=bf, chunk=chunk))):
        start = time.perf_counter()
        try:
            got = jax.block_until_ready(fwd_bwd(fn)(q_c, q_r, c, k_r, idx, kept, do))
        except Exception as error:  # pylint: disable=broad-exception-caught  # a row with its error, the rest go on
            report["check"][name] = {"error": f"{type(error).__name__}: {error}"[:800]}
            print(f"check: {name}: FAIL ({report['check'][name]['error']})", flush=True)
            ok = False
            save()
            continue
        errors = {key: relative(a, e) for key, a, e in zip(GRADS, got, expected)}
        max_logit = float(np.max(np.abs(np.asarray(got[-1], np.float64) - np.asarray(expected[-1], np.float64))))
        verdict = kernel_check.passes(errors, "bfloat16")
        ok &= verdict or "yardstick" in name
        report["check"][name] = {**errors, "max_logit_abs_diff": max_logit, "pass": verdict,
                                 "s": round(time.perf_counter() - start, 2)}
        print(f"check: {name}: " + ", ".join(f"{key} {value:.2e}" for key, value in errors.items())
              + f", largest logit per head within {max_logit:.2e} (tolerance "
              f"{kernel_check.TOLERANCE['bfloat16']}): {'PASS' if verdict else 'FAIL'}", flush=True)
        save()
    del expected
    start = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(indexer.combine)(index_q, index_w, index_k), np.float64)
    for name, fn in (("index scores kernel", lambda *x: index_scores.index_scores(*x, interpret=interpret)),
                     ("index scores jnp (default precision)", indexer.combine)):
        error = relative(jax.jit(fn)(index_q, index_w, index_k), want)
        verdict = error <= kernel_check.TOLERANCE["bfloat16"]
        ok &= verdict
        report["check"][name] = {"scores": error, "pass": verdict, "s": round(time.perf_counter() - start, 2)}
        print(f"check: {name}: scores {error:.2e} against float32 at full precision (tolerance "
              f"{kernel_check.TOLERANCE['bfloat16']}): {'PASS' if verdict else 'FAIL'}", flush=True)
    save()

    # ---- speed
    for t in lengths:
        idx, kept = random_choice(t, topk, seed=t)
        kept_pairs = float(jnp.sum(kept))
        q_c = jax.random.normal(keys[0], (1, t, n, c_w), bf)
        q_r = jax.random.normal(keys[1], (1, t, n, r_w), bf)
        c = jax.random.normal(keys[2], (1, t, c_w), bf)
        k_r = jax.random.normal(keys[3], (1, t, r_w), bf)
        do = jax.random.normal(keys[4], (1, t, n, c_w), bf)
        sparse_flops = 2.5 * 2 * kept_pairs * n * (c_w + r_w + c_w)
        iters = args.iters if t <= 16384 else max(2, args.iters // 2)
        items = {
            "selected kernel": lambda: (fwd_bwd(kernel), (q_c, q_r, c, k_r, idx, kept, do), sparse_flops),
            "selected kernel, atomic backward": lambda: (fwd_bwd(lambda *x: kernel(*x, atomic=True)),
                                                         (q_c, q_r, c, k_r, idx, kept, do), sparse_flops),
            "selected kernel forward": lambda: (forward(), (q_c, q_r, c, k_r, idx, kept, do), sparse_flops / 2.5),
            "selected plain jnp": lambda: (fwd_bwd(lambda *x: gather_form(*x, scale=scale, dtype=bf, chunk=128)),
                                           (q_c, q_r, c, k_r, idx, kept, do), sparse_flops),
        }
        index_inputs = (jax.random.normal(keys[5], (1, t, index_heads, index_dim), jnp.float32),
                        jax.random.normal(keys[6], (1, t, index_heads), jnp.float32),
                        jax.random.normal(keys[7], (1, t, index_dim), jnp.float32), jnp.ones((1, t), jnp.int32))
        for name, fused in (("indexer choice", False), ("indexer choice, fused scores", True)):
            items[name] = lambda fused=fused, t=t: (
                jax.jit(lambda *x: selected.chosen(*x, topk=topk, block=selected.query_block(t), fused=fused)),
                index_inputs, 2 * t * selected.scored_keys(t) * index_heads * index_dim)

        def scores_alone(t=t):
            """The fused scores of every query block against all keys, each block's summed (no top_k): the
            indexer choice's time less this is its top_k's and masks'."""
            bq = selected.query_block(t)

            def every_block(q, w, k, seg):
                del seg  # no masks: every key
                blocks = lambda x: jnp.moveaxis(x.reshape(1, t // bq, bq, *x.shape[2:]), 1, 0)  # noqa: E731
                return jax.lax.map(lambda qw: jnp.sum(index_scores.index_scores(*qw, k, interpret=interpret)),
                                   (blocks(q), blocks(w)))
            return jax.jit(every_block), index_inputs, 2 * t * t * index_heads * index_dim
        items["fused scores alone, every key"] = scores_alone
        if not args.dry_run:
            dense = kernel_check.implementation("cudnn", causal=True, platform=platform)

            def dense_item(t=t, dense=dense):
                q, k, v, d = (jax.random.normal(key, (1, t, n, 192), bf) for key in keys[:4])
                flops = (kernel_check.attention_flops(1, t, t, n, 192) + kernel_check.attention_flops(1, t, t, n, 128)) / 2
                return kernel_check.fwd_bwd(dense), (q, k, v, None, d), flops
            items["dense cudnn"] = dense_item
        if t == lengths[0]:  # tiles (heads x keys, warps): the forward, and with the atomic backward
            for bh, bk, warps in args.tiles:
                tiles = dict(block_heads=bh, block_k=bk, num_warps=warps)
                items[f"forward tiles {bh}x{bk} w{warps}"] = lambda tiles=tiles: (
                    forward(**tiles), (q_c, q_r, c, k_r, idx, kept, do), sparse_flops / 2.5)
                items[f"fwd+bwd tiles {bh}x{bk} w{warps}"] = lambda tiles=tiles: (
                    fwd_bwd(lambda *x: kernel(*x, atomic=True, **tiles)), (q_c, q_r, c, k_r, idx, kept, do),
                    sparse_flops)
        for name, build in items.items():
            label = f"{name} T{t}"
            if time.perf_counter() - began > args.budget:
                report["skipped"].append(label)
                print(f"speed: {label}: skipped (--budget {args.budget:.0f} s spent)", flush=True)
                continue
            try:
                program, operands, flops = build()
                start = time.perf_counter()
                jax.block_until_ready(program(*operands))
                first = time.perf_counter() - start
                ms = 1e3 * metrics.median_seconds(program, *operands, warmup=0, iters=iters)
            except Exception as error:  # pylint: disable=broad-exception-caught  # out of memory: a row, go on
                report["speed"][label] = {"error": f"{type(error).__name__}: {error}"[:800]}
                print(f"speed: {label}: {report['speed'][label]['error']}", flush=True)
                save()
                continue
            report["speed"][label] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 2),
                                      "compile_and_first_s": round(first, 1), "tokens": t, "iters": iters}
            print(f"speed: {label}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s (compile and first run {first:.1f} s, "
                  f"median of {iters})", flush=True)
            save()
        kernel_ms = report["speed"].get(f"selected kernel T{t}", {}).get("ms")
        dense_ms = report["speed"].get(f"dense cudnn T{t}", {}).get("ms")
        choice_ms = report["speed"].get(f"indexer choice T{t}", {}).get("ms")
        if kernel_ms and dense_ms:
            print(f"speed: T{t}: selected kernel {kernel_ms:.1f} ms = {kernel_ms / dense_ms:.3f}x dense cuDNN's "
                  f"{dense_ms:.1f} ms; with the indexer's choice {kernel_ms + (choice_ms or 0):.1f} ms = "
                  f"{(kernel_ms + (choice_ms or 0)) / dense_ms:.3f}x", flush=True)
    report["seconds"] = round(time.perf_counter() - began, 1)
    save()
    print(f"selected check: {'every check passed' if ok else 'a check FAILED'} on {report['device']} "
          f"({report['seconds']} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_cli("gpu_selected_check", main))

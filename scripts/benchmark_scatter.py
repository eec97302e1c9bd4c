"""The gradient of a per-expert table gathered by row (an expert bias): a gather's scatter-add against a one-hot
matmul (models/expert_matmuls.expert_rows), timed on this device beside what compile/predict.py predicts for each.

    python scripts/benchmark_scatter.py                                   # gpt-oss-shaped: 16,384 rows, 16 experts
    python scripts/benchmark_scatter.py --rows 32768 --experts 128 --dtypes bfloat16 --json scatter.json

Why: `gpt-oss-shaped b1 dropless`, measured on an H100 when dropless still gathered its expert biases, ran 2.2x
its predicted step (docs/scale.md); its 12 bfloat16 scatter-adds a step, each row of an expert adding into the same
elements, are the suspect (XLA:GPU adds 16-bit floats with a compare-and-swap loop; the roofline sees 0.03 ms).
This measures that scatter's rate, which the prediction does not model, and the one-hot matmul that replaced it.
The rows are sorted by expert, as dropless sorts them; each expert gets rows / experts of them.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from maxtrain import storage
from maxtrain.compile import predict
from maxtrain.config import chips
from maxtrain.errors import run_cli
from maxtrain.models.moe import expert_matmuls
from maxtrain.observability import metrics


def predicted_seconds(compiled, device) -> float | None:
    """compile/predict.py's time for the compiled function on this device's chip record; None without one."""
    chip = chips.by_device_kind(device.device_kind)
    if chip is None or chip.bf16_flops is None or chip.hbm_bytes_per_s is None:
        return None
    costs = predict.program_costs(compiled.as_text(), devices=[device], mesh_shape={})
    return predict.predict(costs, chip, model_flops_per_step=0.0, tokens_per_step=1.0, num_chips=1)["step_seconds"]


def measure(rows: int, experts: int, width: int, dtype: str, repeats: int) -> list[dict]:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    row_experts = jnp.sort(jax.random.randint(keys[0], (rows,), 0, experts))
    table = jax.random.normal(keys[1], (experts, width)).astype(dtype)
    dy = jax.random.normal(keys[2], (rows, width)).astype(dtype)
    ways = {"gather (scatter-add gradient)": lambda t: jnp.take(t, row_experts, axis=0),
            "one-hot matmul (expert_rows)": lambda t: expert_matmuls.expert_rows(t, row_experts)}
    out = []
    for name, forward in ways.items():
        gradient = jax.jit(lambda t, g, forward=forward: jax.vjp(forward, t)[1](g)[0])
        seconds = metrics.median_seconds(gradient, table, dy, warmup=1, iters=repeats)
        predicted = predicted_seconds(gradient.lower(table, dy).compile(), jax.devices()[0])
        out.append({"way": name, "dtype": dtype, "rows": rows, "experts": experts, "width": width,
                    "ms": seconds * 1e3, "ns_per_update": seconds / (rows * width) * 1e9,
                    "predicted_ms": predicted * 1e3 if predicted is not None else None})
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="benchmark_scatter", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=16384, help="rows (token x expert choices; default 16,384)")
    parser.add_argument("--experts", type=int, default=16, help="experts (default 16)")
    parser.add_argument("--width", type=int, default=2880, help="the table's width (default 2,880, gpt-oss's)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated (default bfloat16,float32)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls after a warm-up (default 10)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    for flag in ("rows", "experts", "width", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be >= 1")
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("bfloat16", "float16", "float32")]
    if bad or not dtypes:
        parser.error(f"--dtypes: {', '.join(bad) or 'none given'}; choose from bfloat16, float16, float32")
    if args.json:
        storage.check_output(args.json, True, f"--json {args.json}")
    device = jax.devices()[0]
    print(f"{device.device_kind}, jax {jax.__version__}: rows {args.rows:,} into {args.experts} experts x "
          f"{args.width:,} (each element added to {args.rows / args.experts:,.0f} times)")
    results = [r for dtype in dtypes for r in measure(args.rows, args.experts, args.width, dtype, args.repeats)]
    for r in results:
        predicted = f"{r['predicted_ms']:.3f}" if r["predicted_ms"] is not None else "-"
        print(f"  {r['dtype']:9s} {r['way']:30s} {r['ms']:9.3f} ms  {r['ns_per_update']:7.3f} ns an update  "
              f"predicted {predicted} ms")
    print("command: python scripts/benchmark_scatter.py " + " ".join(argv))
    if args.json:
        storage.write_text(args.json, json.dumps(results, indent=1))


if __name__ == "__main__":
    run_cli("benchmark_scatter", main)

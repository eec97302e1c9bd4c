"""The one-GPU report's parts (scripts/gpu_report.py): their columns and notes, running their items into an
observability.report.Report within each part's share of the budget, and the whole report's run."""

from __future__ import annotations

import time

import jax

from maxtrain.gpu_check import items
from maxtrain.gpu_check.plan import BEST_BF16, PARTS, USER_COMMAND, WATCHDOG_GRACE_SECONDS, Plan, make_plan
from maxtrain.observability.report import Report

COLUMNS = {
    "environment": [("value", "value", "{}")],
    "kernels": [("flash", "flash max rel. error", "{:.2e}"),
                ("cudnn", "cudnn", "{:.2e}"), ("tokamax", "tokamax", "{:.2e}"),
                ("dot_product", "jnp in the dtype (yardstick)", "{:.2e}"),
                ("tolerance", "tolerance", "{:g}"), ("verdict", "verdict", "{}")],
    "model": [("attention", "attention", "{}"), ("dtype", "dtype", "{}"), ("loss_value", "loss", "{:.5f}"),
              ("loss", "loss rel. diff", "{:.1e}"), ("grads", "grads rel. L2", "{:.1e}"),
              ("worst_leaf_error", "worst leaf", "{:.1e}"), ("tolerance", "tolerance", "{}"),
              ("verdict", "verdict", "{}")],
    "speed": [("impl", "impl", "{}"), ("head_dim", "head_dim", "{}"), ("length", "T", "{}"), ("batch", "B", "{}"),
              ("ms", "fwd+bwd ms", "{:.3f}"), ("tflops", "TFLOP/s", "{:.4g}"), ("compile_seconds", "compile s", "{:.1f}")],
    "training": [("per_device_batch", "batch", "{}"), ("length", "T", "{}"), ("remat", "remat", "{}"),
                 ("attention", "attention", "{}"), ("compile_seconds", "compile s", "{:.1f}"),
                 ("step_ms", "step ms", "{:.1f}"), ("predicted_ms", "predicted ms", "{:.1f}"),
                 ("predicted_error_percent", "pred. error %", "{:+.0f}"),
                 ("tokens_per_second_per_device", "tokens/s", "{:,.0f}"),
                 ("tflops_per_second_per_device", "TFLOP/s", "{:.4g}"), ("mfu_percent", "MFU %", "{:.1f}"),
                 ("compiled_gib", "compiled GiB", "{:.2f}"), ("peak_gib", "peak GiB", "{:.2f}"),
                 ("loss", "loss", "{}")],
}
COLUMNS["frontier"] = COLUMNS["training"]
COLUMNS["training"] = [*COLUMNS["training"][:4], ("scan_layers", "scanned", "{}"), *COLUMNS["training"][4:],
                       ("vs_best_bf16", "x best bf16", "{:.3f}")]
NOTES = {
    "kernels": "Relative Frobenius error of out, dq, dk, dv (the largest shown) against the float32 reference at "
               "full matmul precision; GQA 4:1, fresh random normal inputs per case.",
    "model": "Loss and gradients of one micro-batch (packed: three documents per row) from the same float32 "
             "params, against dot_product in float32 at full matmul precision.",
    "speed": "Causal, bf16, no segment ids; TFLOP/s = 2.5 x 4*B*T*S*N*H/2 / time (useful matmul work).",
    "training": "Synthetic data; model FLOPs (remat not counted); MFU against the dense bf16 peak. The user's "
                "command: " + " ".join(USER_COMMAND) + " (its attention's reason: report.json, log.txt); best bf16: "
                "+ " + " ".join(BEST_BF16) + "; x best bf16: tokens/s over the best bf16 row's. Predicted ms: "
                "compile/predict.py on this compiled step and the chip's record (a held-out check: docs/scale.md).",
    "frontier": "As training; MoE FLOPs count the active experts only (6 of 64, 4 of 16), MFU against the dense "
                "bf16 peak (float8 too: the dense fp8 peak is twice it). Compare fp8 and muon with the training "
                "part's 'llama3.2-1b b8 remat full' row (bf16, AdamW).",
}


def run_part(report: Report, plan: Plan, name: str, share: float) -> None:
    part = report.part(name, share, COLUMNS[name], NOTES.get(name, ""))
    estimate = plan.estimates.get
    if name == "environment":
        part.run("device and software", items.describe_device)
        part.run("dependencies", items.dependencies)
        part.run("kernel library", items.kernel_library)
        part.run("large matmul", lambda: items.matmul(plan.matmul_n))
    elif name == "kernels":
        for seed, case in enumerate(plan.kernel_cases):
            part.run(case.name, lambda case=case, seed=seed: items.check_kernels(plan, case, seed), kind="kernels",
                     estimate=estimate("kernels", 0))
    elif name == "model":
        reference: dict = {}
        for label, attention, dtype in plan.model_variants:
            if attention == "cudnn" and plan.platform != "gpu":
                part.skip(label, "cuDNN attention needs an NVIDIA GPU")
            elif attention == "tokamax" and (plan.platform != "gpu" or items.tokamax_missing(plan)):
                part.skip(label, items.tokamax_missing(plan) or "tokamax's Mosaic GPU kernel needs an NVIDIA GPU")
            elif reference or label == plan.model_variants[0][0]:
                part.run(label, lambda a=attention, d=dtype: items.model_check(plan, a, d, reference), kind="model",
                         estimate=estimate("model", 0))
            else:
                part.skip(label, "the reference did not run")
    elif name == "speed":
        for head_dim, length in plan.speed_shapes:
            for impl in items.speed_impls(plan, length):
                label = f"{impl} h{head_dim} T{length}"
                if impl == "cudnn" and plan.platform != "gpu":
                    part.skip(label, "cuDNN attention needs an NVIDIA GPU")
                    continue
                if impl == "tokamax" and items.tokamax_missing(plan):
                    part.skip(label, items.tokamax_missing(plan))
                    continue
                part.run(label, lambda i=impl, h=head_dim, t=length: items.speed(plan, i, h, t), kind="speed",
                         estimate=estimate("speed", 0))
    elif name in ("training", "frontier"):
        rows: dict = {}
        for label, overrides in plan.training if name == "training" else plan.frontier:
            kind = "default" if label.startswith("default") else "llama" if label.startswith("llama") else "moe"
            part.run(label, lambda label=label, o=overrides: against_best_bf16(rows, label, items.training(plan, o)),
                     kind=kind, estimate=estimate(kind, 0))


def against_best_bf16(rows: dict, label: str, row: dict) -> dict:
    """The row, kept by label; an fp8 row of the best bf16 configuration gets its tokens/s over that row's."""
    rows[label] = row
    best = rows.get(label.removesuffix(" fp8"))
    if label.endswith(" fp8") and best and best.get("tokens_per_second_per_device"):
        row["vs_best_bf16"] = row["tokens_per_second_per_device"] / best["tokens_per_second_per_device"]
    return row


def run(out: str, budget: float, dry_run: bool, parts: list[str], command: str, start: float) -> int:
    """The report's parts, in order, sharing `budget` seconds from `start` (time.monotonic()) in PARTS' proportions;
    report.json and report.md in `out`, the markdown printed. 1 when a check failed or could not run, else 0."""
    plan = make_plan(dry_run)
    header = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
              "device": jax.devices()[0].device_kind, "dry_run": dry_run}
    report = Report(out, budget, "maxtrain on one GPU" + (" (dry run on CPU)" if dry_run else ""), header, start=start)
    report.start_watchdog(WATCHDOG_GRACE_SECONDS)
    for name in parts:  # the parts chosen share the whole budget in PARTS' proportions
        run_part(report, plan, name, PARTS[name] / sum(PARTS[p] for p in parts))
    report.finish()
    print("\n" + report.markdown(), flush=True)
    # a failed check, or a check or training run that could not run (the speed part's errors are measurements)
    failed = [r for p in report.parts for r in p.rows if str(r.get("verdict", "")).startswith("FAIL")
              or ("error" in r and p.name in ("kernels", "model", "training"))]
    return 1 if failed else 0

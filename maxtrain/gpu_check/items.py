"""The one-GPU report's items (scripts/gpu_report.py), each returning one row: the environment, a kernel's output
and gradients against the float32 reference, the 2-layer model's loss and gradients against dot_product in float32,
an attention's forward+backward speed, and a training step's figures beside its predicted step time."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import time
import tomllib

import jax
import jax.numpy as jnp
import numpy as np

import maxtrain
from maxtrain.compile import fit, predict
from maxtrain.config import chips
from maxtrain.gpu_check.plan import Plan, load
from maxtrain.models.attention import kernel_check, kernel_choice
from maxtrain.models.attention.kernel_check import Case
from maxtrain.observability import environment, metrics
from maxtrain.parallel import sharding
from maxtrain.training import builder, measure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(maxtrain.__file__)))  # pyproject.toml's folder


def describe_device() -> dict:
    info = environment.describe()
    memory = info.get("memory_bytes_limit")
    memory = "n/a" if memory is None else f"{memory / 2**30:.1f} GiB"
    info["value"] = (f"{info['device_kind']} x{info['device_count']}, memory for JAX {memory}, compute capability "
                     f"{info.get('compute_capability')}; driver {info.get('smi_driver_version', 'n/a')}, CUDA "
                     f"runtime {info.get('cuda_runtime', 'n/a')}, cuDNN {info.get('cudnn', 'n/a')}, jax {info['jax']} "
                     f"(jaxlib {info['jaxlib']}), Python {info['python']}; MFU peak "
                     f"{info['peak_tflops_bf16_dense']} TFLOP/s (dense bf16, the chip records, config/chips.py)")
    return info


def dependencies() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        required = tomllib.load(f)["project"]["dependencies"]
    rows = environment.package_versions(required)
    off = [f"{r['package']} {r['version']} (wants {r['wanted']})" for r in rows if not r["ok"]]
    return {"packages": rows, "value": "all in pyproject.toml's ranges" if not off else "outside: " + ", ".join(off)}


def kernel_library() -> dict:
    """Whether the [gpu] extra's tokamax is here, its version, and what autoselected chooses among."""
    if not kernel_choice.tokamax_installed():
        return {"tokamax": None, "value": "tokamax not installed: attention=autoselected chooses among cudnn and "
                                          "flash (dot_product where neither runs the model)"}
    version = importlib.metadata.version("tokamax")
    if kernel_choice.tokamax_jax_mismatch():
        return {"tokamax": version, "value": f"tokamax {kernel_choice.tokamax_jax_mismatch()}: not a candidate of "
                                             "attention=autoselected; its rows are skipped"}
    return {"tokamax": version, "value": f"tokamax {version}: a candidate of attention=autoselected where "
                                         "config/attention_speeds.MEASURED has its rows"}


MATMUL = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))


def matmul(n: int) -> dict:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    seconds = metrics.median_seconds(MATMUL, a, b, warmup=2, iters=10)
    tflops = 2 * n**3 / seconds / 1e12
    return {"tflops": tflops, "value": f"bf16 {n}^3 on random data: {tflops:.1f} TFLOP/s (median of 10)"}


def tokamax_missing(plan: Plan) -> str | None:
    """Why tokamax is not checked or timed here, or None: it needs the [gpu] extra, and an sm90 or sm100 GPU
    (the dry run checks the wrapper with tokamax's XLA reference, where installed)."""
    if not kernel_choice.tokamax_installed():
        return "tokamax is not installed (the [gpu] extra; scripts/gpu_wheels.sh carries it)"
    if plan.platform == "gpu":
        why = kernel_choice.unsupported("tokamax", "gpu", kernel_choice.Shape(
            head_dim=128, capability=getattr(jax.devices()[0], "compute_capability", None)))
        return f"tokamax {why}" if why else None
    return None


def kernel_impls(plan: Plan, case: Case) -> list:
    """flash always; for bf16 also cuDNN (GPU only), tokamax (where installed) and the plain jnp attention in
    bf16 (the yardstick)."""
    if case.dtype != "bfloat16":
        return ["flash"]
    return (["flash", "dot_product"] + (["cudnn"] if plan.platform == "gpu" else [])
            + (["tokamax"] if tokamax_missing(plan) is None else []))


def speed_impls(plan: Plan, length: int) -> list:
    """The candidates autoselected chooses among, and dot_product at the shortest length (its [B, N, T, S]
    scores: a yardstick, not a candidate where a kernel runs)."""
    return [i for i in kernel_check.IMPLEMENTATIONS
            if i != "dot_product" or length == min(t for _, t in plan.speed_shapes)]


def kernel_programs(plan: Plan, case: Case, devices=None) -> dict:
    """The jitted (q, k, v, segment_ids, do) -> (out, dq, dk, dv) of the reference and each implementation."""
    programs = {"reference": kernel_check.fwd_bwd(kernel_check.reference(case.causal))}
    for name in kernel_impls(plan, case):
        programs[name] = kernel_check.fwd_bwd(kernel_check.implementation(
            name, causal=case.causal, platform=plan.platform, block_q=case.block_q, block_k=case.block_k,
            interpret=plan.interpret, devices=devices))
    return programs


def check_kernels(plan: Plan, case: Case, seed: int) -> dict:
    """The case's implementations against the float32 reference: relative errors of out, dq, dk, dv."""
    q, k, v, seg, do = kernel_check.inputs(case, seed)
    programs = kernel_programs(plan, case)
    expected = programs.pop("reference")(q, k, v, seg, do)
    tolerance = kernel_check.TOLERANCE[case.dtype]
    row, failed = {"tolerance": tolerance}, []
    if case.dtype == "bfloat16" and "cudnn" not in programs:
        row["cudnn"] = "not run: needs an NVIDIA GPU"
    if case.dtype == "bfloat16" and "tokamax" not in programs:
        row["tokamax"] = f"not run: {tokamax_missing(plan)}"
    for name, program in programs.items():
        try:
            errors = kernel_check.relative_errors(program(q, k, v, seg, do), expected)
        except Exception as error:  # pylint: disable=broad-except  # e.g. cuDNN refusing a shape: reported
            row[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            continue
        row[f"{name}_errors"] = errors
        row[name] = max(errors.values())
        if name != "dot_product" and not kernel_check.passes(errors, case.dtype):
            failed.append(f"{name} " + ", ".join(f"{k} {e:.2g}" for k, e in errors.items() if not e <= tolerance))
    row["verdict"] = "PASS" if not failed and isinstance(row.get("flash"), float) else "FAIL " + "; ".join(failed)
    return row


MODEL_TOLERANCE = {"float32": {"loss": 1e-4, "grads": 5e-3}, "bfloat16": {"loss": 5e-3, "grads": 5e-2}}


def model_batch(config, seed: int = 0) -> dict:
    """One micro-batch [B, T] of random tokens packed as three documents per row and padding (weight 0)."""
    b, t = config.global_batch_size, config.max_target_length
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, config.vocab_size, size=(b, t + 1), dtype=np.int32)
    seg = kernel_check.packed_segment_ids(b, t, seed)
    starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(t), 0), axis=1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
            "positions": (np.arange(t) - starts).astype(np.int32), "loss_weights": (seg > 0).astype(np.float32)}


def model_run(plan: Plan, attention: str, dtype: str, devices=None):
    """The 2-layer model's run (builder.build) with this attention and dtype; its loss and gradients are
    measure.loss_and_grads(run)."""
    return builder.build(load([*plan.model_overrides, f"attention={attention}", f"dtype={dtype}"]), devices=devices)


def model_check(plan: Plan, attention: str, dtype: str, reference: dict) -> dict:
    """The 2-layer model's loss and gradients with this attention and dtype, against the reference (the first
    variant: its figures are stored in `reference` and it compares with itself)."""
    run = model_run(plan, attention, dtype)
    rules = run.config.logical_axis_rules
    batch = jax.device_put(model_batch(run.config), run.eval_batch_sharding)
    precision = jax.default_matmul_precision("highest") if not reference else contextlib.nullcontext()
    with sharding.activation_sharding(run.mesh, rules), precision:
        params = reference["params"] if reference else run.init(jax.random.key(0))["params"]
        loss, grads = measure.loss_and_grads(run)(params, batch)
    if not reference:
        reference.update(params=params, loss=float(loss), grads=grads)
    tolerance = MODEL_TOLERANCE[dtype]
    errors = measure.relative_tree_errors(grads, reference["grads"])
    errors["loss"] = abs(float(loss) - reference["loss"]) / abs(reference["loss"])
    ok = errors["loss"] <= tolerance["loss"] and errors["grads"] <= tolerance["grads"]
    return {"attention": run.rt.attention, "dtype": dtype, "loss_value": float(loss), **errors,
            "tolerance": f"loss {tolerance['loss']:g}, grads {tolerance['grads']:g}", "verdict": "PASS" if ok else "FAIL"}


def speed_case(plan: Plan, head_dim: int, length: int) -> Case:
    heads, kv_heads = plan.speed_heads
    return Case(batch=max(1, plan.speed_tokens // length), length=length, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, causal=True, packed=False)


def speed_program(plan: Plan, impl: str, devices=None):
    """The jitted causal forward + backward the speed part times."""
    return kernel_check.fwd_bwd(kernel_check.implementation(impl, causal=True, platform=plan.platform,
                                                                  interpret=plan.interpret, devices=devices))


def speed(plan: Plan, impl: str, head_dim: int, length: int) -> dict:
    case, (heads, _) = speed_case(plan, head_dim, length), plan.speed_heads
    q, k, v, seg, do = kernel_check.inputs(case, seed=length + head_dim)
    start = time.perf_counter()
    program = speed_program(plan, impl).lower(q, k, v, seg, do).compile()
    compile_seconds = time.perf_counter() - start
    needed, limit = fit.compiled_bytes(program), (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if needed and limit and needed > limit:  # dot_product's [B, N, T, S] scores at 16k tokens: 112 GiB on an H100
        raise MemoryError(f"needs {needed / 2**30:.1f} GiB, more than JAX has on this GPU ({limit / 2**30:.1f} GiB); "
                          f"not run (compiled in {compile_seconds:.1f} s)")
    warmup, iters = plan.speed_iters
    seconds = metrics.median_seconds(program, q, k, v, seg, do, warmup=warmup, iters=iters)
    tflops = kernel_check.attention_flops(case.batch, length, length, heads, head_dim) / seconds / 1e12
    return {"impl": impl, "head_dim": head_dim, "length": length, "batch": case.batch,
            "compile_seconds": compile_seconds, "ms": seconds * 1e3, "tflops": tflops}


def training(plan: Plan, overrides: list) -> dict:
    warmup, steps = plan.train_steps
    before = measure.device_peak_bytes()
    run, step_fn, state, batches, compile_seconds = measure.build(load(overrides, warmup + steps))
    timings = measure.new_timings()
    with sharding.activation_sharding(run.mesh, run.config.logical_axis_rules):
        for i in range(warmup + steps):
            state = measure.timed_step(step_fn, state, batches[i % len(batches)], timings, timed=i >= warmup)
    figures = measure.step_figures(run, timings["times"], step_fn)
    predicted = predicted_step_ms(run, step_fn)
    c = run.config
    del state, step_fn, batches
    gc.collect()
    exact = figures["measured_peak_is"] != "device peak_bytes_in_use" or before is None or \
        figures["measured_peak_bytes"] > before
    return {"model": c.model_name, "per_device_batch": c.per_device_batch_size, "length": c.max_target_length,
            "remat": run.rt.remat_policy, "attention": run.rt.attention, "attention_reason": run.rt.attention_reason,
            "scan_layers": run.rt.scan_layers(c), "quantization": c.quantization, "compile_seconds": compile_seconds,
            **figures, "step_ms": figures["step_seconds_median"] * 1e3,
            "mfu_percent": None if figures["mfu"] is None else 100 * figures["mfu"],
            "predicted_ms": predicted,
            "predicted_error_percent": predicted and 100 * (predicted / 1e3 / figures["step_seconds_median"] - 1),
            "compiled_gib": (figures["compiled_memory_bytes"] or 0) / 2**30,
            "peak_gib": figures["measured_peak_bytes"] / 2**30 if exact else None,
            "peak_note": "" if exact else "the process' high-water mark was set earlier (not this step's)",
            "loss": f"{timings['losses'][0]:.3f} -> {timings['losses'][-1]:.3f}"}


def predicted_step_ms(run, step_fn) -> float | None:
    """compile/predict.py's step time for this compiled step on the device's chip record (ms; None on a CPU)."""
    chip, devices, c = chips.by_device_kind(jax.devices()[0].device_kind), list(run.mesh.devices.flat), run.config
    if chip is None or not (chip.bf16_flops and chip.hbm_bytes_per_s):
        return None
    model_flops = metrics.flops_per_token(run.model) * c.tokens_per_step / len(devices)
    return 1e3 * predict.predict(predict.program_costs(step_fn.as_text(), devices, dict(run.mesh.shape)), chip,
                                 model_flops_per_step=model_flops, tokens_per_step=c.tokens_per_step,
                                 num_chips=len(devices))["step_seconds"]

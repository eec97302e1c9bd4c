"""Proves and times maxtrain on one GPU (an H100 or H200) in one command, within a wall-time budget.

    python scripts/gpu_report.py --out DIR [--budget 420] [--parts kernels,model,...]   # on a GPU
    python scripts/gpu_report.py --out DIR --dry-run      # the same code path on a CPU: tiny shapes, interpret mode
    python scripts/gpu_report.py --print-device-call      # the `device` tool call a session with a lent GPU makes

Parts, in order, each within its share of the budget (compiles included; docs/gpu.md):

    environment  device, memory, driver, CUDA, cuDNN, JAX and dependency versions; the dense bf16 peak used
                 for MFU (the chip records, config/chips.py) and what a large bf16 matmul reaches
    kernels      every attention autoselected can choose, against the float32 jnp reference, output and
                 gradients (bf16 and float32, GQA 4:1, packed segment ids, causal and not, length 1000 (not a
                 multiple of the 128 block), head_dim 64, 128 and 256): flash always; in bf16 cuDNN, tokamax
                 (the [gpu] extra, where installed) and bf16 dot_product (the yardstick) beside it
    model        loss and gradients of a 2-layer model with attention=dot_product|flash|cudnn|tokamax|autoselected
                 against dot_product in float32 at full matmul precision
    speed        forward+backward TFLOP/s of every candidate (flash, cudnn, tokamax; dot_product at 2k tokens):
                 causal, GQA 4:1 (32/8 heads), bf16, head_dim 64, 128 and 256 at 2k, 8k and 16k tokens (16k
                 tokens per batch): the rows of models/attention_choice.MEASURED
    training     llama3.2-1b at sequence 4096, bf16, synthetic data: the user's command as typed (USER_COMMAND,
                 no tuning keys), the best bf16 configuration measured (BEST_BF16), it with quantization=fp8
                 (tokens/s over the best bf16), the former default (flash, remat full); step time, tokens/s,
                 TFLOP/s, MFU, compiled and peak memory; the default model's step
    frontier     (only when named in --parts) the same figures for a DeepSeek-V3-shaped and a gpt-oss-shaped
                 model that fit one GPU, and llama3.2-1b with float8 matmuls and with Muon

A part runs until the end of its share (time a part leaves passes to the next); an item whose estimated
cost exceeds what its part has left is skipped and listed. DIR/report.json and DIR/report.md are
rewritten after every item, so a run cut short leaves what it measured; a watchdog writes them and stops
the process 45 s after the budget (a hung compile). Exit status: 0 when every check that ran passed,
1 when one failed or a check or training run raised, 3 when the watchdog stopped the run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # before JAX starts: the 1B model's larger batches
# pylint: disable=wrong-import-position

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import time
import tomllib

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.compile import fit, predict
from maxtrain.config import chips
from maxtrain.errors import UserError, run_cli
from maxtrain.models import attention_check, attention_choice
from maxtrain.models.attention_check import Case
from maxtrain.observability import environment, metrics
from maxtrain.observability.report import Report
from maxtrain.parallel import sharding
from maxtrain.training import builder, measure

START = time.monotonic()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Budget shares, from the first run on an H200 (2026-11-26, docs/gpu.md): environment 4 s, kernels 118 s,
# model 102 s, speed 56 s, training 80 s (compiles included) of a 420 s budget; since then the speed part's grid
# grew from 15 to 30 items and the training part's llama rows from 3 to 4 (an estimate: not yet run on a GPU).
PARTS = {"environment": 0.03, "kernels": 0.22, "model": 0.18, "speed": 0.24, "training": 0.33, "frontier": 0.3}
# The command a user types (issue 45), no tuning keys: the training part runs it as it stands.
USER_COMMAND = ["model_name=llama3.2-1b", "max_target_length=4096", "dtype=bfloat16", "per_device_batch_size=8",
                "dataset_type=synthetic"]
# The fastest bf16 llama3.2-1b step measured (docs/gpu.md, H200 2026-11-26: 45.3% MFU); fp8 is measured against it.
BEST_BF16 = ["remat_policy=minimal", "attention=cudnn", "scan_layers=false"]
DEFAULT_PARTS = ("environment", "kernels", "model", "speed", "training")
WATCHDOG_GRACE_SECONDS = 45
BUDGET_SECONDS = 420
# The `device` tool call (docs/gpu.md shows it; tests/test_gpu_report.py checks the copy): the wheels the GPU
# image lacks (scripts/gpu_wheels.sh puts them in .whl/) go to /tmp/site, then the report runs; the log comes
# back in $OUT even when the timeout stops the pipeline. 540 s leaves the budget, its grace, and a rerun.
DEVICE_CALL = {
    "command": ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
                "/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && "
                f"python3 scripts/gpu_report.py --out $OUT --budget {BUDGET_SECONDS} 2>&1 | tee $OUT/log.txt"),
    "carry": [".whl"],
    "timeout_s": 540,
}


def device_call_text() -> str:
    """DEVICE_CALL as JSON, one argument a line (docs/gpu.md shows it verbatim)."""
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in DEVICE_CALL.items()) + "\n}"


@dataclasses.dataclass
class Plan:
    """Everything the report runs: the GPU's shapes, or tiny ones for --dry-run (same code path)."""
    dry_run: bool
    platform: str                  # "gpu", or "cpu" for the dry run
    matmul_n: int
    kernel_cases: list
    model_overrides: list          # the 2-layer model
    model_variants: list           # (label, attention, dtype); the first is the reference
    speed_heads: tuple             # (query heads, kv heads)
    speed_tokens: int              # per batch: batch = max(1, tokens // length)
    speed_shapes: list             # (head_dim, length)
    speed_iters: tuple             # (warm-up, timed)
    training: list                 # (label, overrides)
    frontier: list                 # (label, overrides): the new families, float8 and Muon
    train_steps: tuple             # (warm-up, timed)
    estimates: dict                # kind -> seconds an item is expected to take at first

    @property
    def interpret(self) -> bool:
        return self.platform == "cpu"


def kernel_cases(dry_run: bool) -> list:
    """bf16 first (what training runs; head_dim 64 is llama3.2-1b's), then float32; causal before full."""
    if dry_run:
        shape = dict(batch=1, length=40, heads=4, kv_heads=1, block_q=16, block_k=16)
        head_dims = (16, 32, 64)
    else:
        shape = dict(batch=2, length=1000, heads=8, kv_heads=2)
        head_dims = (128, 64, 256)
    cases = [Case(head_dim=h, dtype=d, causal=c, **shape)
             for d in ("bfloat16", "float32") for c in (True, False) for h in head_dims]
    cases.insert(1, Case(head_dim=head_dims[0], dtype="bfloat16", causal=True, packed=False, **shape))
    if dry_run:  # interpret mode is slow: each dtype, mask, packing and head_dim once (3 of the 13)
        cases = [cases[i] for i in (1, 5, 9)]
    return cases


def training_runs(dry_run: bool) -> list:
    """(label, overrides) of the training part's llama3.2-1b rows: the user's command, the best bf16
    configuration, it with fp8 (compared with it: run_part), the former default; compiled for one H100
    (tests/test_gpu_report_lowering.py): 23.6, 43.4, 42.6 and 23.3 GiB. The dry run shrinks the model and runs
    the first row only, with CPU attention (no cuDNN there)."""
    user = USER_COMMAND[:]
    if dry_run:
        user = config_lib.with_overrides(user, "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=1",
                                         "head_dim=16", "base_mlp_dim=128", "base_num_decoder_layers=2",
                                         "vocab_size=512", "max_target_length=64", "per_device_batch_size=2")
        return [("llama3.2-1b user's command", user)]
    return [("llama3.2-1b user's command", user),
            ("llama3.2-1b best bf16", [*user, *BEST_BF16]),
            ("llama3.2-1b best bf16 fp8", [*user, *BEST_BF16, "quantization=fp8"]),
            ("llama3.2-1b b8 remat full flash (former default)", [*user, "remat_policy=full", "attention=flash"])]


def make_plan(dry_run: bool) -> Plan:
    llama = ["model_name=llama3.2-1b", "max_target_length=4096", "dtype=bfloat16", "dataset_type=synthetic"]
    if dry_run:
        llama = config_lib.with_overrides(llama, "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=1",
                                          "head_dim=16", "base_mlp_dim=128", "base_num_decoder_layers=2",
                                          "vocab_size=512", "max_target_length=64")
    training = training_runs(dry_run)
    default = ["model_name=default", "dtype=bfloat16", "dataset_type=synthetic"]
    training.append(("default model", default + (["max_target_length=64", "per_device_batch_size=2"] if dry_run
                                                  else [])))
    frontier = frontier_runs(llama[:], dry_run)
    model = ["base_num_decoder_layers=2", "dataset_type=synthetic", "remat_policy=full"] + (
        ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=1", "head_dim=16", "base_mlp_dim=128",
         "vocab_size=256", "max_target_length=48", "per_device_batch_size=1"] if dry_run else
        ["base_emb_dim=1024", "base_num_query_heads=8", "base_num_kv_heads=2", "head_dim=128", "base_mlp_dim=2816",
         "vocab_size=4096", "max_target_length=1024", "per_device_batch_size=2"])
    variants = [("dot_product float32 (reference)", "dot_product", "float32"),
                ("dot_product bf16", "dot_product", "bfloat16"), ("flash bf16", "flash", "bfloat16"),
                ("cudnn bf16", "cudnn", "bfloat16"), ("tokamax bf16", "tokamax", "bfloat16"),
                ("autoselected bf16", "autoselected", "bfloat16"), ("flash float32", "flash", "float32")]
    return Plan(
        dry_run=dry_run, platform="cpu" if dry_run else "gpu", matmul_n=256 if dry_run else 8192,
        kernel_cases=kernel_cases(dry_run), model_overrides=model, model_variants=variants,
        speed_heads=(4, 1) if dry_run else (32, 8), speed_tokens=128 if dry_run else 16384,
        speed_shapes=[(16, 128), (32, 64)] if dry_run else
        [(h, t) for h in (128, 64, 256) for t in (2048, 8192, 16384)],
        speed_iters=(1, 2) if dry_run else (2, 10), training=training, frontier=frontier,
        train_steps=(1, 2) if dry_run else (2, 8),
        estimates={} if dry_run else {"kernels": 8, "model": 15, "speed": 6, "llama": 80, "default": 20, "moe": 60})


# DeepSeek-V3's architecture at a width one GPU trains with AdamW (2.37B parameters, 0.87B active): its MLA
# head dims (q rank 1536, latent 512, q/k 128 + 64, values 128), a dense first layer, 64 routed experts of
# width 1408 (6 per token from 4 of 8 groups, sigmoid, selection bias) and 2 shared ones, its 129,280 vocabulary.
DEEPSEEK_SHAPED = ["model_name=deepseek3-671b", "base_emb_dim=2048", "base_num_query_heads=16",
                   "base_num_kv_heads=16", "base_mlp_dim=10944", "base_moe_mlp_dim=1408", "base_num_decoder_layers=4",
                   "first_num_dense_layers=1", "num_experts=64", "num_experts_per_tok=6", "shared_experts=2"]
# gpt-oss-20b's layers (width 2880, 64/8 heads of 64, sinks, 128-token windows every other layer, clamped
# SwiGLU experts with biases, 4 per token) with 4 layers and 16 of its 32 experts (2.86B parameters, 1.66B active).
GPT_OSS_SHAPED = ["model_name=gpt-oss-20b", "base_num_decoder_layers=4", "num_experts=16"]
TINY_MOE = ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128",
            "base_moe_mlp_dim=32", "num_experts=8", "vocab_size=512", "max_target_length=64", "base_num_decoder_layers=2"]


def frontier_runs(llama: list, dry_run: bool) -> list:
    """(label, overrides) of the frontier part: the MoE families at sequence 4096 and llama3.2-1b b8 (remat
    full, the training part's first row) with float8 matmuls and with Muon."""
    common = ["max_target_length=4096", "dtype=bfloat16", "dataset_type=synthetic", "remat_policy=full"]
    deepseek, gpt_oss = [*DEEPSEEK_SHAPED, *common], [*GPT_OSS_SHAPED, *common]
    if dry_run:
        deepseek = config_lib.with_overrides(
            deepseek, *TINY_MOE, "head_dim=24", "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=16",
            "qk_rope_head_dim=8", "v_head_dim=16", "num_experts_per_tok=2", "n_routing_groups=4",
            "topk_routing_group=2")
        gpt_oss = config_lib.with_overrides(gpt_oss, *TINY_MOE, "head_dim=16", "num_experts_per_tok=2",
                                            "sliding_window_size=16")
    b = 1 if dry_run else 8
    dense = [*llama, f"per_device_batch_size={b}", "remat_policy=full"]
    # dropless at capacity's batch: on a GPU its experts run the Pallas grouped GEMM (moe_grouped_matmul=
    # autoselected), computing only the routed rows. (XLA's ragged_dot, the form before it, computed every expert:
    # the DeepSeek-shaped step needed 118 GiB at batch 4, and ran at 0.10x capacity's tokens/s at batch 1.)
    big = 1 if dry_run else 4
    gpt_big = 1 if dry_run else 2
    return [(f"deepseek-shaped b{big} capacity", [*deepseek, f"per_device_batch_size={big}", "moe_dispatch=capacity"]),
            (f"gpt-oss-shaped b{gpt_big} capacity", [*gpt_oss, f"per_device_batch_size={gpt_big}",
                                                      "moe_dispatch=capacity"]),
            (f"llama3.2-1b b{b} remat full fp8", [*dense, "quantization=fp8"]),
            (f"llama3.2-1b b{b} remat full muon", [*dense, "opt_type=muon"]),
            (f"deepseek-shaped b{big} dropless", [*deepseek, f"per_device_batch_size={big}"]),
            (f"gpt-oss-shaped b{gpt_big} dropless", [*gpt_oss, f"per_device_batch_size={gpt_big}"]),
            (f"llama3.2-1b b{b} remat full fp8_mlp", [*dense, "quantization=fp8_mlp"])]


def load(overrides: list, steps: int = 1):
    """The config of base.yml, the measured-run settings and `overrides`."""
    return builder.load_config(config_lib.with_overrides(
        [config_lib.BASE_CONFIG, *measure.MEASURE_OVERRIDES, f"steps={steps}"], *overrides), log=lambda *_: None)


# ----------------------------------------------------------------------------------------------
# The parts' items: each returns one row.


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
    if not attention_choice.tokamax_installed():
        return {"tokamax": None, "value": "tokamax not installed: attention=autoselected chooses among cudnn and "
                                          "flash (dot_product where neither runs the model)"}
    version = importlib.metadata.version("tokamax")
    return {"tokamax": version, "value": f"tokamax {version}: a candidate of attention=autoselected where "
                                         "models/attention_choice.MEASURED has its rows"}


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
    if not attention_choice.tokamax_installed():
        return "tokamax is not installed (the [gpu] extra; scripts/gpu_wheels.sh carries it)"
    if plan.platform == "gpu":
        return attention_choice.unsupported("tokamax", "gpu", attention_choice.Shape(
            head_dim=128, capability=getattr(jax.devices()[0], "compute_capability", None)))
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
    return [i for i in attention_check.IMPLEMENTATIONS
            if i != "dot_product" or length == min(t for _, t in plan.speed_shapes)]


def kernel_programs(plan: Plan, case: Case, devices=None) -> dict:
    """The jitted (q, k, v, segment_ids, do) -> (out, dq, dk, dv) of the reference and each implementation."""
    programs = {"reference": attention_check.fwd_bwd(attention_check.reference(case.causal))}
    for name in kernel_impls(plan, case):
        programs[name] = attention_check.fwd_bwd(attention_check.implementation(
            name, causal=case.causal, platform=plan.platform, block_q=case.block_q, block_k=case.block_k,
            interpret=plan.interpret, devices=devices))
    return programs


def kernel_check(plan: Plan, case: Case, seed: int) -> dict:
    """The case's implementations against the float32 reference: relative errors of out, dq, dk, dv."""
    q, k, v, seg, do = attention_check.inputs(case, seed)
    programs = kernel_programs(plan, case)
    expected = programs.pop("reference")(q, k, v, seg, do)
    tolerance = attention_check.TOLERANCE[case.dtype]
    row, failed = {"tolerance": tolerance}, []
    if case.dtype == "bfloat16" and "cudnn" not in programs:
        row["cudnn"] = "not run: needs an NVIDIA GPU"
    if case.dtype == "bfloat16" and "tokamax" not in programs:
        row["tokamax"] = f"not run: {tokamax_missing(plan)}"
    for name, program in programs.items():
        try:
            errors = attention_check.relative_errors(program(q, k, v, seg, do), expected)
        except Exception as error:  # pylint: disable=broad-except  # e.g. cuDNN refusing a shape: reported
            row[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            continue
        row[f"{name}_errors"] = errors
        row[name] = max(errors.values())
        if name != "dot_product" and not attention_check.passes(errors, case.dtype):
            failed.append(f"{name} " + ", ".join(f"{k} {e:.2g}" for k, e in errors.items() if not e <= tolerance))
    row["verdict"] = "PASS" if not failed and isinstance(row.get("flash"), float) else "FAIL " + "; ".join(failed)
    return row


MODEL_TOLERANCE = {"float32": {"loss": 1e-4, "grads": 5e-3}, "bfloat16": {"loss": 5e-3, "grads": 5e-2}}


def model_batch(config, seed: int = 0) -> dict:
    """One micro-batch [B, T] of random tokens packed as three documents per row and padding (weight 0)."""
    b, t = config.global_batch_size, config.max_target_length
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, config.vocab_size, size=(b, t + 1), dtype=np.int32)
    seg = attention_check.packed_segment_ids(b, t, seed)
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
    return attention_check.fwd_bwd(attention_check.implementation(impl, causal=True, platform=plan.platform,
                                                                  interpret=plan.interpret, devices=devices))


def speed(plan: Plan, impl: str, head_dim: int, length: int) -> dict:
    case, (heads, _) = speed_case(plan, head_dim, length), plan.speed_heads
    q, k, v, seg, do = attention_check.inputs(case, seed=length + head_dim)
    start = time.perf_counter()
    program = speed_program(plan, impl).lower(q, k, v, seg, do).compile()
    compile_seconds = time.perf_counter() - start
    needed, limit = fit.compiled_bytes(program), (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if needed and limit and needed > limit:  # dot_product's [B, N, T, S] scores at 16k tokens: 112 GiB on an H100
        raise MemoryError(f"needs {needed / 2**30:.1f} GiB, more than JAX has on this GPU ({limit / 2**30:.1f} GiB); "
                          f"not run (compiled in {compile_seconds:.1f} s)")
    warmup, iters = plan.speed_iters
    seconds = metrics.median_seconds(program, q, k, v, seg, do, warmup=warmup, iters=iters)
    tflops = attention_check.attention_flops(case.batch, length, length, heads, head_dim) / seconds / 1e12
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
    figures = measure.step_figures(run.config, timings["times"], step_fn)
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
    return 1e3 * predict.predict(predict.program_costs(step_fn.as_text(), devices, dict(run.mesh.shape)), chip,
                                 model_flops_per_step=metrics.flops_per_token(c) * c.tokens_per_step / len(devices),
                                 tokens_per_step=c.tokens_per_step, num_chips=len(devices))["step_seconds"]


# ----------------------------------------------------------------------------------------------
# The report


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
        part.run("device and software", describe_device)
        part.run("dependencies", dependencies)
        part.run("kernel library", kernel_library)
        part.run("large matmul", lambda: matmul(plan.matmul_n))
    elif name == "kernels":
        for seed, case in enumerate(plan.kernel_cases):
            part.run(case.name, lambda case=case, seed=seed: kernel_check(plan, case, seed), kind="kernels",
                     estimate=estimate("kernels", 0))
    elif name == "model":
        reference: dict = {}
        for label, attention, dtype in plan.model_variants:
            if attention == "cudnn" and plan.platform != "gpu":
                part.skip(label, "cuDNN attention needs an NVIDIA GPU")
            elif attention == "tokamax" and (plan.platform != "gpu" or tokamax_missing(plan)):
                part.skip(label, tokamax_missing(plan) or "tokamax's Mosaic GPU kernel needs an NVIDIA GPU")
            elif reference or label == plan.model_variants[0][0]:
                part.run(label, lambda a=attention, d=dtype: model_check(plan, a, d, reference), kind="model",
                         estimate=estimate("model", 0))
            else:
                part.skip(label, "the reference did not run")
    elif name == "speed":
        for head_dim, length in plan.speed_shapes:
            for impl in speed_impls(plan, length):
                label = f"{impl} h{head_dim} T{length}"
                if impl == "cudnn" and plan.platform != "gpu":
                    part.skip(label, "cuDNN attention needs an NVIDIA GPU")
                    continue
                if impl == "tokamax" and tokamax_missing(plan):
                    part.skip(label, tokamax_missing(plan))
                    continue
                part.run(label, lambda i=impl, h=head_dim, t=length: speed(plan, i, h, t), kind="speed",
                         estimate=estimate("speed", 0))
    elif name in ("training", "frontier"):
        rows: dict = {}
        for label, overrides in plan.training if name == "training" else plan.frontier:
            kind = "default" if label.startswith("default") else "llama" if label.startswith("llama") else "moe"
            part.run(label, lambda label=label, o=overrides: against_best_bf16(rows, label, training(plan, o)),
                     kind=kind, estimate=estimate(kind, 0))


def against_best_bf16(rows: dict, label: str, row: dict) -> dict:
    """The row, kept by label; an fp8 row of the best bf16 configuration gets its tokens/s over that row's."""
    rows[label] = row
    best = rows.get(label.removesuffix(" fp8"))
    if label.endswith(" fp8") and best and best.get("tokens_per_second_per_device"):
        row["vs_best_bf16"] = row["tokens_per_second_per_device"] / best["tokens_per_second_per_device"]
    return row


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpu_report", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", help="folder for report.json and report.md (on the device machine: $OUT)")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                        help=f"wall seconds for all parts, compiles included (default {BUDGET_SECONDS})")
    parser.add_argument("--dry-run", action="store_true", help="run on this CPU with tiny shapes (interpret mode)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated, in order, of {', '.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--print-device-call", action="store_true", help="print the `device` tool call and exit")
    args = parser.parse_args(argv)
    given, args.parts = args.parts, [p for p in args.parts.split(",") if p]
    if not args.parts:
        parser.error(f"--parts {given!r} names no part; choose from {', '.join(PARTS)}")
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if not args.print_device_call and not args.out:
        parser.error("--out DIR is required (on the device machine: --out $OUT)")
    if not args.budget > 0 or args.budget == float("inf"):  # nan compares false
        parser.error(f"--budget {args.budget} must be a finite number of seconds > 0")
    if args.out:  # the report is written as the parts finish: refused before the first
        storage.check_output(args.out, False, f"--out {args.out}")
    return args


def main(argv):
    args = parse_args(argv)
    if args.print_device_call:
        print(device_call_text())
        return 0
    backend = jax.default_backend()
    if not args.dry_run and backend != "gpu":
        raise UserError(f"no GPU here (JAX's backend is {backend}): run this on a lent GPU (docs/gpu.md, "
                        "--print-device-call), or add --dry-run to check the command on this CPU")
    plan = make_plan(args.dry_run)
    header = {"command": "python scripts/gpu_report.py " + " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M"),
              "device": jax.devices()[0].device_kind, "dry_run": args.dry_run}
    report = Report(args.out, args.budget, "maxtrain on one GPU" + (" (dry run on CPU)" if args.dry_run else ""),
                    header, start=START)
    report.start_watchdog(WATCHDOG_GRACE_SECONDS)
    for name in args.parts:  # the parts chosen share the whole budget in PARTS' proportions
        run_part(report, plan, name, PARTS[name] / sum(PARTS[p] for p in args.parts))
    report.finish()
    print("\n" + report.markdown(), flush=True)
    # a failed check, or a check or training run that could not run (the speed part's errors are measurements)
    failed = [r for p in report.parts for r in p.rows if str(r.get("verdict", "")).startswith("FAIL")
              or ("error" in r and p.name in ("kernels", "model", "training"))]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(run_cli("gpu_report", main))

"""What the one-GPU report runs (scripts/gpu_report.py): the parts' budget shares, the `device` tool call, and
the Plan of shapes and runs, a GPU's or tiny ones for --dry-run (the same code path on a CPU)."""

from __future__ import annotations

import dataclasses
import json

from maxtrain import config as config_lib
from maxtrain.models.attention.kernel_check import Case
from maxtrain.training import builder, measure

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
# The `device` tool call (docs/gpu.md shows it; tests/gpu_check/test_gpu_report.py checks the copy): the wheels the GPU
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
    (tests/gpu_check/test_gpu_report_lowering.py): 23.6, 43.4, 42.6 and 23.3 GiB. The dry run shrinks the model and runs
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

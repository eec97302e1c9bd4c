"""The attention kernels' measured speeds: one row per measurement, with its device, date and source.

    for row in attention_speeds.MEASURED: row.head_dim, row.tokens, dict(row.tflops)["cudnn"]

Two readers, one table: `attention=autoselected` (models/attention/kernel_choice.py) takes the fastest kernel at the
row nearest a layer kind's shape, and the step-time prediction (compile/predict.py) prices an attention kernel
at its measured rate. Like config/chips.py, this is a measured fact about kernels on chips, so it lives in
config/, the one package below both readers (compile/ sits above models/, and neither should reach into the
other's choice logic for data); it imports nothing, so config's no-JAX contract holds. To add a row: run
scripts/gpu_report.py's speed part on the GPU and copy all the candidates it times at one head_dim and length
(docs/gpu.md, "How `attention=autoselected` chooses on a GPU").

SELECTED holds the selected-key kernel's measured forward+backward (DeepSeek-V3.2's sparse attention; one reader:
compile/predict.selected_rates). To add a row: scripts/gpu_selected_check.py's speed part on the GPU, and its
kernel_ms from compiling the same program (tests/kernels/test_kernel_lowering.py's selected-kernel price test).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured forward+backward: causal, bf16, GQA 4:1 (32/8 heads), no segment ids, 16k tokens
    per batch; TFLOP/s of the useful matmul work (models/kernel_check.attention_flops)."""
    arch: str           # "sm90": compute capability 9.0 (H100, H200)
    head_dim: int
    tokens: int         # sequence length
    tflops: tuple       # ((implementation, TFLOP/s), ...)
    device: str
    date: str
    source: str


_H200 = ("H200", "2026-11-26", "docs/gpu.md, scripts/gpu_report.py speed part (jax 0.11.2, cuDNN 9.19)")
_H200_1130 = ("H200", "2026-11-30", "docs/gpu.md, scripts/gpu_report.py speed part (jax 0.11.2, cuDNN 9.19)")
# docs/gpu.md "Measured". tokamax has no row yet: it is a candidate the report times (scripts/gpu_report.py),
# chosen by autoselected once a row here shows it faster; on 2026-11-30 tokamax 0.0.12 could not run with the GPU
# machine's jax 0.11.2 (kernel_choice.tokamax_jax_mismatch). That day's rows at shapes measured before are in
# docs/gpu.md only (within 8% of these); the new shapes are here.
MEASURED = (
    Row("sm90", 128, 2048, (("cudnn", 227.6), ("flash", 162.9), ("dot_product", 24.0)), *_H200),
    Row("sm90", 128, 8192, (("cudnn", 349.3), ("flash", 201.2), ("dot_product", 25.08)), *_H200),
    Row("sm90", 128, 16384, (("cudnn", 365.1), ("flash", 214.0), ("dot_product", 27.19)), *_H200),
    Row("sm90", 64, 8192, (("cudnn", 272.4), ("flash", 76.1), ("dot_product", 13.82)), *_H200),
    Row("sm90", 256, 8192, (("cudnn", 285.4), ("flash", 155.3), ("dot_product", 40.95)), *_H200),
    Row("sm90", 64, 2048, (("cudnn", 171.0), ("flash", 51.43), ("dot_product", 13.16)), *_H200_1130),
    Row("sm90", 64, 16384, (("cudnn", 297.9), ("flash", 57.24)), *_H200_1130),
    Row("sm90", 256, 2048, (("cudnn", 225.4), ("flash", 126.9), ("dot_product", 38.87)), *_H200_1130),
    Row("sm90", 256, 16384, (("cudnn", 294.1), ("flash", 150.1)), *_H200_1130),
    Row("sm90", 128, 8192, (("cudnn", 358.7), ("flash", 199.9)), "H100", "2026-11-26",
        "docs/gpu.md, scripts/gpu_report.py speed part (jax 0.11.2, cuDNN 9.19)"),
)


@dataclasses.dataclass(frozen=True)
class SelectedRow:
    """One measured forward+backward of the selected-key kernel (kernels/selected_attention.py, its default backward:
    forward, dq and rows kernels and XLA's scatter-adds of the rows): bf16, batch 1, causal, random keys among those
    each query sees (min(t + 1, K) kept), scripts/gpu_selected_check.py's speed part."""
    arch: str
    tokens: int         # T = S
    heads: int
    index_topk: int     # K, the chosen keys per query
    latent: int         # C
    rope: int           # R
    ms: float           # the whole program
    tflops: float       # as the script counts: 2.5 x 2 x kept pairs x heads x (2C + R) / ms
    # of ms, the three Triton kernels': ms less what compile/predict.py prices the program's XLA kernels at (the
    # scatter-adds of the float32 rows, memory-bound), from compiling the same program for an H100
    # (tests/kernels/test_kernel_lowering.py checks it against this calibration)
    kernel_ms: float
    device: str
    date: str
    source: str


_H200_1201 = ("H200", "2026-12-01",
              "docs/gpu.md \"Sparse attention on a GPU\", scripts/gpu_selected_check.py (jax 0.11.2)")
SELECTED = (
    SelectedRow("sm90", 16384, 16, 2048, 512, 64, 173.0, 15.8, 146.0, *_H200_1201),
    SelectedRow("sm90", 65536, 16, 2048, 512, 64, 669.9, 17.2, 527.3, *_H200_1201),
)

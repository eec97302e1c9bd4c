"""Throughput and MFU: the FLOPs model, the device peak table, and the metric writers.

FLOPs per token come from the model family (maxtrain/models/<family>.py, `flops_per_token`):
"model FLOPs" of training, 3 x the forward pass's matmuls (so remat recomputation does not count),
causal attention counted once and sliding windows counting only the keys attended. See
models.blocks.decoder_flops for the dense decoder formula.

MFU = achieved model TFLOP/s per device / the device's dense bfloat16 peak (below, or
`peak_tflops_per_device`).
"""

from __future__ import annotations

import json
import os
import struct

import jax

from maxtrain import models
from maxtrain.errors import ConfigError

# Dense (no sparsity) bfloat16 peak TFLOP/s per device, from the vendors' data sheets.
# Matched against jax.Device.device_kind, longest key first.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,           # SXM
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "V100": 125.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,    # v5e
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,    # Trillium (v6e)
    "TPU v6e": 918.0,
}


def flops_per_token(config, dense_attention: bool = False) -> float:
    """Training FLOPs per token (the family's formula; dense_attention counts every key of the T x T
    scores, as a dense implementation computes them)."""
    return models.flops_per_token(config, dense_attention)


def peak_tflops(config, device=None) -> float | None:
    """Per-device peak used for MFU, or None when unknown (CPU without peak_tflops_per_device)."""
    if config.peak_tflops_per_device > 0:
        return config.peak_tflops_per_device
    kind = (device or jax.devices()[0]).device_kind
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in kind.lower():
            return PEAK_TFLOPS[key]
    return None


def step_metrics(raw: dict, step_time: float, config, peak: float | None) -> dict:
    """MaxText-named metrics for one step from the train step's scalars and the measured time."""
    tokens_per_device = config.tokens_per_step / config.num_devices
    tflops_per_device = flops_per_token(config) * tokens_per_device / step_time / 1e12
    return {
        "learning/loss": float(raw["loss"]),
        "learning/grad_norm": float(raw["grad_norm"]),
        "learning/current_learning_rate": float(raw["learning_rate"]),
        "learning/loss_scale": float(raw["loss_scale"]),
        "learning/skipped_steps": int(raw["skipped_steps"]),
        "perf/step_time_seconds": step_time,
        "perf/per_device_tokens_per_sec": tokens_per_device / step_time,
        "perf/per_device_tflops_per_sec": tflops_per_device,
        "perf/mfu": tflops_per_device / peak if peak else None,
        **{f"learning/{k[4:]}": float(v) for k, v in raw.items() if k.startswith("aux/")},
    }


def format_line(step: int, m: dict, loss_scaled: bool = False) -> str:
    """One console line; float16 runs (loss_scaled) also show the loss scale and skipped steps."""
    mfu = m.get("perf/mfu")
    parts = [f"step {step:>6}", f"loss {m['learning/loss']:.4f}", f"grad_norm {m['learning/grad_norm']:.3f}",
             f"lr {m['learning/current_learning_rate']:.2e}", f"step_time {m['perf/step_time_seconds']:.3f}s",
             f"tokens/s/device {m['perf/per_device_tokens_per_sec']:,.0f}",
             f"TFLOP/s/device {m['perf/per_device_tflops_per_sec']:.3f}",
             f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"]
    if loss_scaled or m.get("learning/skipped_steps"):
        parts.append(f"loss_scale {m['learning/loss_scale']:g} skipped {m['learning/skipped_steps']}")
    if "eval/avg_loss" in m:
        parts.append(f"eval_loss {m['eval/avg_loss']:.4f}")
    return " | ".join(parts)


def _writable_place(path: str, key: str, is_file: bool) -> None:
    """ConfigError naming `key` when `path` could not be created or written (checked before any work)."""
    path = os.path.abspath(path)
    if is_file and os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a directory; give a file path, e.g. {key}={os.path.join(path, 'metrics.jsonl')}")
    if not is_file and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a file, not a directory; choose a directory")
    existing = os.path.dirname(path) if is_file else path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{key}={path!r} cannot be created: {existing} is a file, not a directory. Choose a path "
                          "inside a directory")
    target = path if os.path.exists(path) else existing
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{key}={path!r} cannot be written: no write permission on {target}. Choose a writable path")


def check_outputs(config) -> None:
    """Fails before any work when an output of the run could not be written."""
    _writable_place(config.base_output_directory, "base_output_directory", is_file=False)
    if config.metrics_file:
        _writable_place(config.metrics_file, "metrics_file", is_file=True)


class MetricWriter:
    """Writes metrics to stdout, an optional JSON-lines file and TensorBoard; only on process 0."""

    def __init__(self, config, active: bool):
        self.active = active
        self.config = config
        self.jsonl = None
        self.tb = None
        if not active:
            return
        if config.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(config.metrics_file)), exist_ok=True)
            self.jsonl = open(config.metrics_file, "a", encoding="utf-8")
        if config.enable_tensorboard:
            from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

            self.tb = SummaryWriter(config.tensorboard_dir)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.tb:
            self.tb.add_text(tag, text, step)

    def write_image(self, tag: str, png_bytes: bytes, step: int) -> None:
        """An encoded PNG as a TensorBoard image (no imaging library needed)."""
        if not self.tb:
            return
        from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=import-outside-toplevel

        width, height = struct.unpack(">II", png_bytes[16:24])  # from the PNG's IHDR chunk
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png_bytes)
        self.tb._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)  # pylint: disable=protected-access

    def write(self, step: int, metrics: dict, print_line: bool) -> None:
        if not self.active:
            return
        if print_line:
            print(format_line(step, metrics, loss_scaled=self.config.dtype == "float16"), flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in metrics.items():
                if value is not None:
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()

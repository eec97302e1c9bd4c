"""Throughput and MFU: the FLOPs model, the device peak table, and the metric writers.

FLOPs per token come from the model family (maxtrain/models/<family>.py, `flops_per_token`):
"model FLOPs" of training, 3 x the forward pass's matmuls (so remat recomputation does not count),
causal attention counted once and sliding windows counting only the keys attended. See
models.blocks.decoder_flops for the dense decoder formula. An image-and-text run adds its tower's FLOPs per image
(contract.Vision.flops, Model.vision_flops) over the rows' patch budget (flops_per_token's image_patches_per_row),
image by image where each takes a fixed block (patches_per_image).

MFU = achieved model TFLOP/s per device / the device's dense bfloat16 peak (below, or
`peak_tflops_per_device`). A CPU has no data sheet peak: there MFU is measured against what a
large matmul achieves on this machine (cpu_peak_tflops: measured once, 1.5 s at most, and cached),
divided among the CPU devices, which share the cores.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import struct
import time

import jax

from maxtrain import storage
from maxtrain.models.model import Model
from maxtrain.config import chips
from maxtrain.observability.wandb_logger import WandbLogger


def flops_per_token(model: Model, dense_attention: bool = False, image_patches_per_row: int = 0,
                    patches_per_image: int = 0) -> float:
    """Training FLOPs per token of the bound model (the family's formula; dense_attention counts every key of
    the T x T scores, as a dense implementation computes them). With image_patches_per_row (a run reading image
    conversations: each row's images padded to that many patches) each row's tokens also carry the image tower's
    training FLOPs (Model.vision_flops) for its images: the tower runs on the rows' whole patch budget every step, as
    the decoder on the padding tokens the text count includes. A tower whose images each take a fixed block
    (patches_per_image: Gemma 4's max_soft_tokens x pooling**2) counts row / block images of a block each, since it
    runs image by image; else one image of the row's budget, the most attention those patches can hold (smaller
    images attend over fewer)."""
    text = model.flops_per_token(dense_attention)
    if image_patches_per_row <= 0:
        return text
    block = patches_per_image if 0 < patches_per_image <= image_patches_per_row else image_patches_per_row
    images = image_patches_per_row // block
    return text + images * model.vision_flops(block) / model.config.max_target_length


def peak_tflops(config, device=None, log=None) -> float | None:
    """Per-device peak used for MFU, or None when unknown. On CPU: the measured matmul peak of the
    machine (see cpu_peak_tflops) shared by the local CPU devices; process 0 only measures it."""
    if config.peak_tflops_per_device > 0:
        return config.peak_tflops_per_device
    device = device or jax.devices()[0]
    table = table_peak_tflops(device)
    if table is not None:
        return table
    if getattr(device, "platform", None) == "cpu" and jax.process_index() == 0:
        dtype = "bfloat16" if config.dtype == "bfloat16" else "float32"
        # Several processes: the others would wait in the first step's collectives while this one
        # measures (and time out), so only a figure cached by an earlier single-process run is used.
        peak, path, measured = cpu_peak_tflops(dtype, measure=jax.process_count() == 1)
        if peak is None:
            if log:
                log(f"MFU: this CPU's matmul peak is not measured yet ({path}); a single-process run measures and "
                    "caches it, or set peak_tflops_per_device")
            return None
        devices = jax.local_device_count()
        if log:
            when = "measured now" if measured else "measured before"
            log(f"MFU: against this CPU's {dtype} matmul peak of {peak:.3f} TFLOP/s ({when}, "
                f"cached in {path}) shared by {devices} CPU device(s); set peak_tflops_per_device to use another")
        return peak / devices
    return None


def table_peak_tflops(device=None) -> float | None:
    """The device's dense bfloat16 peak in TFLOP/s from its chip record (config/chips.py, by device_kind), or None."""
    chip = chips.by_device_kind((device or jax.devices()[0]).device_kind)
    return chip.bf16_flops / chips.TERA if chip and chip.bf16_flops else None


def median_seconds(fn, *args, warmup: int = 2, iters: int = 10) -> float:
    """Median wall seconds of fn(*args) (device work: until block_until_ready) over `iters` runs after
    `warmup` untimed ones (the first compiles, when fn is a jit not yet compiled)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul_tflops(dtype, n: int = 4096, repeats: int = 10, reduce=statistics.median,
                          budget_seconds: float | None = None) -> float:
    """TFLOP/s of an n x n x n matmul (float32 accumulation) on the default device: `reduce` (median,
    or max for a peak) over `repeats` timed runs after one untimed, or fewer (at least one) when
    they would take longer than `budget_seconds`."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(lambda x, y: jax.numpy.dot(x, y, preferred_element_type=jax.numpy.float32))
    jax.block_until_ready(matmul(a, b))
    times, start = [], time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        times.append(time.perf_counter() - t)
        if budget_seconds is not None and time.perf_counter() - start > budget_seconds:
            break
    return reduce([2 * n**3 / t / 1e12 for t in times])


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_tflops(dtype: str = "float32", measure: bool = True) -> tuple[float | None, str, bool]:
    """(TFLOP/s, cache file, measured now?): the best of up to 20 runs (1.5 s at most) of a 1024^3
    matmul on this machine.

    Cached in $XDG_CACHE_HOME/maxtrain/cpu_peak_tflops.json (default ~/.cache), keyed by the CPU
    model, the number of cores this process may use, the jax version and the dtype: what the figure
    depends on. The best run, not the median, because a shared machine's load only ever slows it
    down; for the same reason a figure measured while the load average exceeded the core count is
    measured again by later runs, and the best one kept, until one is measured on a quiet machine.
    Delete the file to measure again. measure=False only reads the cache (None when it has no figure).
    """
    path = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "maxtrain",
                        "cpu_peak_tflops.json")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{_cpu_name()} | {cores} cores | jax {jax.__version__} | {dtype}"
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached.get(key), dict) else {}
    if entry.get("tflops", 0) > 0 and (entry.get("load_average", 0) <= cores or not measure):
        return float(entry["tflops"]), path, False
    if not measure:
        return None, path, False
    # Not yet measured, or measured while the machine was busier than it has cores (the figure is
    # then too low): measure (again), keeping the best figure seen.
    load = os.getloadavg()[0]
    tflops = measure_matmul_tflops(getattr(jax.numpy, dtype), n=1024, repeats=20, reduce=max, budget_seconds=1.5)
    if entry.get("tflops", 0) >= tflops:
        tflops, load = entry["tflops"], min(load, entry.get("load_average", load))
    cached[key] = {"tflops": tflops, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "how": "best of up to 20 runs (1.5 s) of a 1024^3 matmul, float32 accumulation, jax.devices()[0]",
                   "load_average": load}
    try:
        storage.write_text(path, json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only home: measured again next time
    return tflops, path, True


def step_metrics(raw: dict, step_time: float, config, flops: float, peak: float | None) -> dict:
    """MaxText-named metrics for one step from the train step's scalars and the measured time (flops: the
    model's training FLOPs per token, flops_per_token)."""
    tokens_per_device = config.tokens_per_step / config.num_devices
    tflops_per_device = flops * tokens_per_device / step_time / 1e12
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
    if "learning/moe_lb_loss" in m:
        parts.append(moe_summary(m))
    if "learning/mtp_ce" in m:  # multi-token prediction (models/mtp.py): the modules' mean cross-entropy
        parts.append(f"mtp_ce {m['learning/mtp_ce']:.4f} mtp_loss {m['learning/mtp_loss']:.4f}")
    if "learning/grpo_reward" in m:  # GRPO (training/grpo.py): the rollouts' figures and the step's two parts
        parts.append(f"reward {m['learning/grpo_reward']:.3f} kl {m.get('learning/grpo_kl', 0.0):.4f} "
                     f"completion {m['learning/grpo_completion_length']:.1f} tok  rollout "
                     f"{m['learning/grpo_rollout_seconds']:.2f}s update {m['learning/grpo_update_seconds']:.2f}s")
    if "eval/avg_loss" in m:
        parts.append(f"eval_loss {m['eval/avg_loss']:.4f}")
    return " | ".join(parts)


def moe_summary(m: dict) -> str:
    """`moe lb_loss .. z_loss .. load min-max [dropped ..%]` for the console: the smallest and largest
    share of routed tokens any expert took in any layer (1/E each when balanced; every layer's own
    figures are in the metrics file and TensorBoard as learning/moe_load_{min,max}/layer_<i>)."""
    lows = [v for k, v in m.items() if k.startswith("learning/moe_load_min/")]
    highs = [v for k, v in m.items() if k.startswith("learning/moe_load_max/")]
    text = f"moe lb_loss {m['learning/moe_lb_loss']:.3g} z_loss {m.get('learning/moe_z_loss', 0.0):.3g}"
    if lows and highs:
        text += f" load {min(lows):.3f}-{max(highs):.3f}"
    if "learning/moe_dropped_fraction" in m:
        text += f" dropped {100 * m['learning/moe_dropped_fraction']:.1f}%"
    return text


def check_outputs(config) -> None:
    """Fails before any work when an output of the run could not be written (storage.check_output): the
    run directory (base_output_directory/run_name), metrics_file, the data cache (dataset_cache_dir)."""
    storage.check_output(config.base_output_directory, False,
                         f"base_output_directory={storage.abspath(config.base_output_directory)!r}")
    storage.check_output(config.run_dir, False, f"the run directory {storage.abspath(config.run_dir)!r}",
                         " (it is base_output_directory/run_name: or choose another run_name)")
    if config.metrics_file:
        path = storage.abspath(config.metrics_file)
        hint = f", e.g. metrics_file={os.path.join(path, 'metrics.jsonl')}" if os.path.isdir(path) else ""
        storage.check_output(config.metrics_file, True, f"metrics_file={path!r}", hint)
    if config.dataset_cache_dir or config.dataset_type == "default":  # the default corpus caches its tokens
        storage.check_output(config.cache_dir, False, f"dataset_cache_dir={storage.abspath(config.cache_dir)!r}",
                             "" if config.dataset_cache_dir else " (the default: <base_output_directory>/cache)")


class JsonLines:
    """Appends lines to a file. A local file is opened for appending and flushed after every line. GCS
    has no append, so a gs:// object is rewritten whole (what it held before, then the new lines) at
    most every `upload_seconds` and at close: a killed run loses at most that much of its metrics file."""

    def __init__(self, path: str, upload_seconds: float = 30.0):
        self.path, self.upload_seconds = path, upload_seconds
        self.remote = storage.is_remote(path)
        if self.remote:
            self.lines = [storage.read_text(path)] if storage.isfile(path) else []
            self.uploaded = time.time()
            self.dirty = False
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # pylint: disable=consider-using-with

    def write(self, line: str) -> None:
        if not self.remote:
            self.file.write(line)
            self.file.flush()
            return
        self.lines.append(line)
        self.dirty = True
        if time.time() - self.uploaded >= self.upload_seconds:
            self.upload()

    def upload(self) -> None:
        if self.dirty:
            storage.write_text(self.path, "".join(self.lines))
            self.uploaded, self.dirty = time.time(), False

    def close(self) -> None:
        if self.remote:
            self.upload()
        else:
            self.file.close()


class MetricWriter:
    """Writes metrics to stdout, an optional JSON-lines file, TensorBoard and W&B; only on process 0."""

    def __init__(self, config, active: bool):
        self.active = active
        self.config = config
        self.jsonl = None
        self.tb = None
        self.wandb = None
        if not active:
            return
        if config.metrics_file:
            self.jsonl = JsonLines(config.metrics_file)
        if config.enable_tensorboard:
            from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

            self.tb = SummaryWriter(config.tensorboard_dir)
        if config.enable_wandb:

            self.wandb = WandbLogger(config)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.tb:
            self.tb.add_text(tag, text, step)

    def write_image(self, tag: str, png_bytes: bytes, step: int) -> None:
        """An encoded PNG as a TensorBoard image (no imaging library needed), and a W&B image."""
        if self.wandb:
            self.wandb.log_image(tag, png_bytes, step)
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
        if self.tb:
            for key, value in metrics.items():
                if value is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(step, metrics)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.close()

"""What a measurement ran on: the device, its memory, driver, CUDA, cuDNN, JAX and the dependencies'
versions (scripts/gpu_report.py's first part; any figure is worth only as much as this says).

Every field is read, never assumed: one that cannot be read says why (no nvidia-smi, no CUDA plugin).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import subprocess
import sys

import jax

from maxtrain.observability import metrics

# The CUDA plugins JAX loads, newest first: each has a _versions module that asks the libraries it loaded.
_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def _cuda_versions() -> dict:
    for name in _CUDA_PLUGINS:
        try:
            versions = importlib.import_module(f"{name}._versions")
        except ImportError:
            continue
        out = {"cuda_plugin": name}
        for key, call in (("cuda_runtime", "cuda_runtime_get_version"), ("cuda_driver_api", "cuda_driver_get_version"),
                          ("cudnn", "cudnn_get_version"), ("cublas", "cublas_get_version")):
            try:
                out[key] = _dotted(getattr(versions, call)(), key)
            except Exception as error:  # pylint: disable=broad-except  # no GPU, or a plugin without the call
                out[key] = f"unknown ({type(error).__name__})"
        return out
    return {"cuda_plugin": "none (no jax_cuda13_plugin or jax_cuda12_plugin)"}


def _dotted(number: int, key: str) -> str:
    """CUDA's 12090 -> 12.9; cuDNN's 91000 -> 9.10.0 and cuBLAS's 120903 -> 12.9.3 (each library's encoding)."""
    if key in ("cudnn", "cublas"):
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number % 1000 // 10}"


def nvidia_smi() -> dict:
    """name, memory.total, driver_version of GPU 0 as nvidia-smi reports them, or why not."""
    fields = ("name", "memory.total", "driver_version", "clocks.max.sm", "power.limit")
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia_smi": f"not available ({type(error).__name__})"}
    if done.returncode != 0 or not done.stdout.strip():
        return {"nvidia_smi": f"failed (exit {done.returncode}): {done.stderr.strip()[:200]}"}
    values = [v.strip() for v in done.stdout.strip().splitlines()[0].split(",")]
    return {f"smi_{f.replace('.', '_')}": v for f, v in zip(fields, values)}


def package_versions(requirements: list[str]) -> list[dict]:
    """For each requirement ("grain>=0.2.12,<0.3") that applies to this Python (environment markers:
    "jax>=0.11.2,<0.13; python_version >= '3.12'"): the installed version and whether it is in range."""
    try:
        from packaging.requirements import Requirement  # pylint: disable=import-outside-toplevel
    except ImportError:
        Requirement = None  # pylint: disable=invalid-name
    rows = []
    for text in requirements:
        name, spec = text, None
        if Requirement is not None:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate():
                continue  # for another Python
            name, spec = req.name, req.specifier
        else:
            name = name.split(";")[0]
            for sep in ("<", ">", "=", "!", "~"):
                name = name.split(sep)[0]
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            rows.append({"package": name, "version": None, "wanted": str(spec or ""), "ok": False})
            continue
        ok = spec.contains(version, prereleases=True) if spec is not None else None
        rows.append({"package": name, "version": version, "wanted": str(spec or ""), "ok": ok})
    return rows


def describe() -> dict:
    """The first device and the software around it."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    info = {
        "device_kind": device.device_kind, "platform": device.platform, "device_count": jax.device_count(),
        "compute_capability": getattr(device, "compute_capability", None),
        "memory_bytes_limit": stats.get("bytes_limit"),
        "peak_tflops_bf16_dense": metrics.table_peak_tflops(device),
        "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
        "python": sys.version.split()[0], "machine": platform.machine(), "host": platform.node(),
    }
    if device.platform == "gpu":
        info.update(_cuda_versions())
        info.update(nvidia_smi())
    return info

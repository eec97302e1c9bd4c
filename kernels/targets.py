"""Devices of accelerators this machine does not have, for compiling kernels (and steps) ahead of time.

JAX compiles for a TPU pod or a GPU host from a CPU-only machine when the target's compiler is
installed: libtpu (`pip install -e .[tpu]`) for TPUs, the CUDA PJRT plugin and ptxas
(`pip install -e .[cuda]`) for NVIDIA GPUs. `jax.experimental.topologies` then describes the
target's devices; a Mesh over them, arguments as ShapeDtypeStructs with NamedShardings, and
`jit(...).trace(...).lower(lowering_platforms=(platform,)).compile()` run the target's real
compiler (Mosaic for Pallas TPU kernels, Triton and ptxas down to sm_90a for GPU ones).

GPU targets are described by the text GpuTargetConfigProto files in gpu_targets/ (each says
where its figures come from).
"""

from __future__ import annotations

import importlib.util
import os

GPU_TARGETS = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm.txtpb"}
_GPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")


class MissingCompiler(RuntimeError):
    """The target's compiler is not installed; the message names the extra that installs it."""


def tpu_compiler_missing() -> str | None:
    """Why TPU programs cannot be compiled here, or None when they can."""
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed: pip install -e '.[tpu]' (the TPU compiler, for jax 0.10.2: libtpu 0.0.42.1)"
    return None


def gpu_compiler_missing() -> str | None:
    """Why NVIDIA GPU programs cannot be compiled here, or None when they can."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return ("the CUDA plugin is not installed: pip install -e '.[cuda]' "
                "(JAX's CUDA 12 plugin with NVIDIA's ptxas and cuDNN)")
    return None


def tpu_devices(topology: str, num_slices: int = 1):
    """Devices of a TPU topology such as "v5e:2x2", "v5p:2x2x1" or "v6e:4x4" (chips per dimension)."""
    missing = tpu_compiler_missing()
    if missing:
        raise MissingCompiler(missing)
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) so that one process owns the TPU chips;
    # compiling uses no chip, and without this a second compiling process (another test run, a
    # train_compile) fails with "Internal error when accessing libtpu multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=num_slices).devices


def gpu_target_config(name: str) -> str:
    """The text GpuTargetConfigProto of a GPU named in GPU_TARGETS."""
    if name not in GPU_TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(GPU_TARGETS)}")
    with open(os.path.join(_GPU_DIR, GPU_TARGETS[name]), encoding="utf-8") as f:
        return f.read()


def gpu_devices(name: str = "h100", gpus_per_host: int = 8, hosts: int = 1):
    """Devices of `hosts` hosts with `gpus_per_host` GPUs of kind `name` each (one slice)."""
    missing = gpu_compiler_missing()
    if missing:
        raise MissingCompiler(missing)
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

    return topologies.get_topology_desc(platform="cuda", topology_name=name, target_config=gpu_target_config(name),
                                        topology=f"1x{hosts}x{gpus_per_host}").devices

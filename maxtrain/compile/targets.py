"""Compile targets: the one table of TPU and GPU kinds maxtrain compiles for, and their devices by name.

    target = targets.parse("v5p-128", num_slices=2)      # MaxText's names
    devices = target.devices()                          # jax.experimental.topologies, no TPU needed

Names (`compile_topology`, with `compile_topology_num_slices`):

    v4-N, v5p-N        N TensorCores, two per chip (v5p-128 = 64 chips as a 4x4x4 torus)
    v5e-N, v6e-N       N chips (v5e-256 = a 16x16 pod); v5litepod-N is v5e-N
    v7x-N              N TensorCores, two per chip and each its own device (v7x-8 = 4 chips, 2x2x1, 8 devices);
                       tpu7x-N is v7x-N
    a3                 one host of 8 H100s (MaxText's name: Google Cloud A3 High, with its network);
                       compile_topology_num_slices = hosts
    h100-N, h200-N     N GPUs, 8 per host; compile_topology_num_slices = copies joined over the network
    a100-N             likewise (kernel lowering tests: the pre-Hopper shared-memory limit)

A TPU slice's chips talk over ICI and slices over DCN, so a `num_slices` target has `dcn_*`
parallelism across its slices. A GPU "slice" is one NVLink/InfiniBand domain: `a3` with
num_slices=H is H hosts each a slice (MaxText's convention), `h100-64` is one slice of 8 hosts.

JAX compiles for these devices on a CPU-only machine when the target's compiler is installed:
libtpu (`pip install -e '.[tpu]'`) for TPUs, JAX's CUDA plugin with ptxas (`pip install -e
'.[cuda]'`) for NVIDIA GPUs. A Mesh over the devices, arguments as ShapeDtypeStructs with
NamedShardings, and `jit(...).lower(...).compile()` run the target's real compiler (Mosaic for Pallas
TPU kernels, Triton and ptxas down to sm_90a for GPU ones). A GPU target is described to XLA by a
text GpuTargetConfigProto shipped in maxtrain/compile/gpu_targets/ (each file says where its figures
come from). train_compile, scale_table and the compiler tests all name targets through `parse`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

from maxtrain.config import chips
from maxtrain.errors import UserError


# How each TPU kind is named and laid out for the compiler; its memory, peaks and bandwidths are its chip
# record's (config/chips.py, the one record per chip). libtpu's chip config "megacore" presents a v4 chip's two
# TensorCores as one device; its "default" already does so for v5p, and v5e and v6e chips have one TensorCore.
# TPU v7x (Ironwood) chips hold two TensorCores presented as two devices (chips.by_name("v7x").devices_per_chip).
TPU_CHIPS = {
    #       topology prefix, chip config, torus dims, cores per chip
    "v4": ("v4", "megacore", 3, 2),
    "v5p": ("v5p", "default", 3, 2),
    "v5e": ("v5e", "default", 2, 1),
    "v6e": ("v6e", "default", 2, 1),
    "v7x": ("tpu7x", "default", 3, 2),
}
TPU_ALIASES = {"v5litepod": "v5e", "v6": "v6e", "v5": "v5p", "tpu7x": "v7x"}

# GPU kinds: the target config file in maxtrain/compile/gpu_targets/ (its device_memory_size, the memory XLA is
# given, is the chip record's memory_bytes: tests/config/test_chips.py checks that they agree).
GPU_TARGET_FILES = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb", "a100": "a100_sxm.txtpb"}
_GPU_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
GPUS_PER_HOST = 8

EXTRA_HINT = {"tpu": "pip install -e '.[tpu]' (libtpu, the TPU compiler)",
              "gpu": "pip install -e '.[cuda]' (JAX's CUDA plugin with ptxas, the NVIDIA GPU compiler)"}


class TargetError(UserError, ValueError):
    """A compile target that cannot be named, built or compiled for here; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str                 # as the user wrote it, e.g. "v5p-128" or "h100-64"
    platform: str             # "tpu" | "gpu" | "cpu" (this machine's devices)
    chip: str                 # "v5p", "h100", ...; "cpu"
    num_slices: int
    chips_per_slice: int
    shape: tuple[int, ...]    # TPU: chips per torus dimension; GPU: (hosts per slice, GPUs per host)
    memory_bytes: int | None  # per device (a chip, but half a v7x chip)
    devices_per_chip: int = 1
    record: str = ""          # the chip record's name where the machine's differs from the chip's (a3: "h100-a3")

    @property
    def num_chips(self) -> int:
        return self.num_slices * self.chips_per_slice

    @property
    def num_devices(self) -> int:
        return self.num_chips * self.devices_per_chip

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Which of a TPU slice's three torus dimensions have wraparound links: v4 and v5p slices made of
        whole 4x4x4 cubes are 3-D tori, smaller ones are meshes; a v5e or v6e slice wraps along a
        dimension that spans the pod's 16 chips (Cloud TPU's system architecture pages). libtpu picks
        its collective algorithms by it: without the links it turned FSDP's all-gathers into
        all-reduces of the whole gathered array."""
        if TPU_CHIPS[self.chip][2] == 3:
            return (all(d % 4 == 0 for d in self.shape),) * 3
        return (self.shape[0] == 16, self.shape[1] == 16, False)

    def describe(self) -> str:
        """`v5p-128 x 2 slices: 128 chips (v5p 4x4x4 per slice)`, `h100-16: 16 GPUs (h100, 2 hosts x 8)`."""
        if self.platform == "cpu":
            return f"this machine: {self.num_chips} {self.chip} device(s)"
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        if self.platform == "tpu":
            each = f", {self.devices_per_chip} devices each" if self.devices_per_chip > 1 else ""
            return (f"{self.name}{slices}: {self.num_chips} chips ({self.chip} {'x'.join(map(str, self.shape))} per "
                    f"slice{each})")
        hosts = self.shape[0] * self.num_slices
        return f"{self.name}{slices}: {self.num_chips} GPUs ({self.chip}, {hosts} host(s) x {self.shape[1]})"

    def devices(self) -> list:
        """The target's devices (jax.experimental.topologies); this machine's own for platform cpu."""
        import jax  # pylint: disable=import-outside-toplevel

        if self.platform == "cpu":
            return jax.devices()
        missing = compiler_missing(self.platform)
        if missing:
            raise TargetError(f"compile_topology={self.name} needs the {self.platform.upper()} compiler: {missing}")
        from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

        if self.platform == "tpu":
            # Compiling touches no TPU, so other processes (another compile, tests) may load libtpu too;
            # without this libtpu takes a machine-wide lock and refuses a second process.
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            quiet_libtpu_without_chips()
            prefix, chip_config = TPU_CHIPS[self.chip][:2]
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, self.shape))}", chip_config_name=chip_config,
                chips_per_host_bounds=(2, 2, 1), num_slices=self.num_slices, wrap=self.wrap)
        else:
            hosts, per_host = self.shape
            desc = topologies.get_topology_desc(
                platform="cuda", topology_name=self.chip, target_config=gpu_target_config(self.chip),
                topology=f"{self.num_slices}x{hosts}x{per_host}")
        devices = list(desc.devices)
        if len(devices) != self.num_devices:
            raise TargetError(f"compile_topology={self.name} gave {len(devices)} devices, expected {self.num_devices} "
                              "(a libtpu or CUDA plugin other than the pinned one?)")
        return devices


def quiet_libtpu_without_chips() -> None:
    """Gives libtpu the two facts it looks for at start-up on a machine with no TPU chip, before it loads.

    Without a chip, jax tells libtpu not to ask the metadata server (TPU_SKIP_MDS_QUERY=1, set by
    `import jax`), and libtpu then fills the accelerator type and worker hostnames with warning texts
    it fails to parse, printing "could not determine TPU accelerator type" and a TPU_WORKER_HOSTNAMES
    error with a source trace: noise for a compile, which uses neither. One host, this one, is what a
    compile-only process is. A TPU VM (chips present) and values the user set are left alone."""
    if os.environ.get("TPU_SKIP_MDS_QUERY") != "1":
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


def compiler_missing(platform: str) -> str | None:
    """Why programs for `platform` cannot be compiled on this machine, or None when they can."""
    # JAX's CUDA 12 plugin (the [cuda] extra) or its CUDA 13 one, which a GPU machine may have instead.
    modules = {"tpu": ("libtpu",), "gpu": ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")}.get(platform)
    if modules is None:
        return None
    return None if any(_importable(m) for m in modules) else f"install it with {EXTRA_HINT[platform]}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def gpu_target_config(chip: str) -> str:
    """The text GpuTargetConfigProto of a GPU kind (comments included; XLA's text parser skips them)."""
    if chip not in GPU_TARGET_FILES:
        raise TargetError(f"unknown GPU target {chip!r}; known: {', '.join(GPU_TARGET_FILES)}")
    with open(os.path.join(_GPU_TARGET_DIR, GPU_TARGET_FILES[chip]), encoding="utf-8") as f:
        return f.read()


def gpu_config_figure(chip: str, field: str) -> int:
    """An integer field of the GPU kind's target config (device_memory_size, shared_memory_per_block_optin, ...)."""
    match = re.search(rf"\b{field}:\s*(\d+)", gpu_target_config(chip))
    if not match:
        raise TargetError(f"the {chip} target config has no {field}")
    return int(match.group(1))


def chip_record(target: Target) -> chips.Chip:
    """The chip record (config/chips.py) of a TPU or GPU target: memory, peaks, bandwidths."""
    return chips.by_name(target.record or target.chip)


def torus_shape(count: int, dims: int) -> tuple[int, ...] | None:
    """Chips per dimension of a TPU slice of `count` chips, as Cloud TPU lays them out, or None.

    2-D (v5e, v6e): powers of two, the longer side at most twice the shorter (8x16, 16x16).
    3-D (v4, v5p): each side 1, 2 or a multiple of 4, as near a cube as possible (4x4x4, 4x4x8,
    4x4x12), the 1 of a single host last (2x2x1).
    """
    if count < 1:
        return None
    if dims == 2:
        if count & (count - 1):
            return None
        side = 1 << (count.bit_length() - 1) // 2
        return (side, count // side)
    best = None
    allowed = [n for n in range(1, count + 1) if count % n == 0 and (n <= 2 or n % 4 == 0)]
    for x in allowed:
        for y in allowed:
            if y < x or count % (x * y):
                continue
            z = count // (x * y)
            if z < y or z not in allowed:
                continue
            key = (z, -x)  # the shortest longest side, then the fattest
            if best is None or key < best[0]:
                best = (key, (x, y, z))
    if best is None:
        return None
    x, y, z = best[1]
    return (y, z, x) if x == 1 else (x, y, z)


_TPU_NAME = re.compile(r"^(v4|v5p|v5e|v6e|v7x|v5litepod|v5|v6|tpu7x)-(\d+)$")
_GPU_NAME = re.compile(r"^(" + "|".join(GPU_TARGET_FILES) + r")-(\d+)$")


def parse(name: str, num_slices: int = 1) -> Target:
    """The Target `compile_topology=name compile_topology_num_slices=num_slices` names."""
    import jax  # pylint: disable=import-outside-toplevel

    if num_slices < 1:
        raise TargetError(f"compile_topology_num_slices={num_slices} must be >= 1")
    if name in ("", "local"):
        devices = jax.devices()
        if num_slices != 1:
            raise TargetError("compile_topology_num_slices needs a compile_topology (e.g. v5p-128 or a3)")
        platform = devices[0].platform.lower()
        return Target(name or "local", "gpu" if platform in ("cuda", "rocm") else platform, devices[0].device_kind,
                      1, len(devices), (len(devices),), None)
    key = name.lower()
    match = _TPU_NAME.match(key)
    if match:
        chip = TPU_ALIASES.get(match.group(1), match.group(1))
        _, _, dims, cores = TPU_CHIPS[chip]
        record = chips.by_name(chip)
        count = int(match.group(2))
        if count % cores:
            raise TargetError(f"compile_topology={name}: {chip} names count TensorCores, {cores} per chip, so the "
                              f"number must be even (e.g. {chip}-{max(cores, count - count % cores)})")
        chips_count = count // cores
        shape = torus_shape(chips_count, dims)
        if shape is None:
            examples = ", ".join(f"{chip}-{n * cores}" for n in ((4, 16, 64, 256) if dims == 2 else (4, 8, 64, 512)))
            raise TargetError(f"compile_topology={name}: {chips_count} {chip} chips do not form a Cloud TPU slice "
                              f"({'powers of two' if dims == 2 else 'sides of 1, 2 or multiples of 4'}); e.g. {examples}")
        return Target(name, "tpu", chip, num_slices, chips_count, shape, record.memory_bytes, record.devices_per_chip)
    if key == "a3":
        return Target(name, "gpu", "h100", num_slices, GPUS_PER_HOST, (1, GPUS_PER_HOST),
                      chips.by_name("h100").memory_bytes, record=chips.A3_HIGH.name)
    match = _GPU_NAME.match(key)
    if match:
        chip, count = match.group(1), int(match.group(2))
        if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST) or GPUS_PER_HOST % min(count, GPUS_PER_HOST):
            raise TargetError(f"compile_topology={name}: {chip} hosts hold {GPUS_PER_HOST} GPUs, so N must be 1, 2, "
                              f"4, 8 or a multiple of 8 (e.g. {chip}-{max(8, count - count % 8)})")
        hosts, per_host = max(1, count // GPUS_PER_HOST), min(count, GPUS_PER_HOST)
        return Target(name, "gpu", chip, num_slices, count, (hosts, per_host), chips.by_name(chip).memory_bytes)
    raise TargetError(
        f"compile_topology={name!r} is not a target this compiler knows. Use a TPU slice by MaxText's name "
        "(v4-8, v5p-128, v5e-256, v6e-64, v7x-8, ...: v4, v5p and v7x count TensorCores, v5e and v6e chips), a3 "
        "(8 H100s; "
        "compile_topology_num_slices=hosts), h100-N, h200-N or a100-N (N GPUs, 8 per host), or '' for this machine.")


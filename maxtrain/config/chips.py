"""One record per accelerator chip: memory, peaks, bandwidths, shared memory and float8 support, with their source.

    chip = chips.by_name("h100")                  # a compile target's chip (compile/targets.py)
    chip = chips.by_device_kind("TPU v5 lite")    # a jax.Device's device_kind (MFU, fp8's checks)
    smem = chips.shared_memory_per_block((9, 0))  # a CUDA compute capability (the flash kernel's tiles)

Every figure is per JAX device: a TPU v4 or v5p chip's two TensorCores are one device (megacore), a v7x chip's two
are two devices (each with half the chip's memory, peak and bandwidth). Peaks are dense (no 2:4 sparsity).
Bandwidths are bytes per second one device moves in one direction: HBM, the fast links inside a slice or NVLink
domain (`link_bytes_per_s`: ICI, NVLink) and the network between slices or hosts (`network_bytes_per_s`: DCN,
InfiniBand/RoCE). Figures a vendor does not publish are None, and readers say so rather than guess.

Why here: the kernels (shared memory), models (via the kernels), observability (MFU), training (fp8's checks) and
compile (targets, the step-time prediction) all read these facts, and config/ is the one package below all of them
(docs/architecture.md). This module imports nothing, so config's no-JAX contract holds. tests/house/test_house.py fails
when a chip's figure or device_kind is written in another module.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
TERA = 1e12
GIGA = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                             # the target's name (compile/targets.py) or a short name
    kind: str                             # "tpu" | "gpu"
    device_kinds: tuple[str, ...]         # substrings of jax.Device.device_kind, matched case-insensitively
    memory_bytes: int | None              # HBM per device
    bf16_flops: float | None              # dense bfloat16 peak FLOP/s per device
    fp8_flops: float | None               # dense float8 peak per device; the bf16 figure where fp8 runs at its rate
    hbm_bytes_per_s: float | None
    link_bytes_per_s: float | None        # ICI (TPU) or NVLink (GPU), one direction, per device
    network_bytes_per_s: float | None     # DCN (TPU) or the host's network share (GPU), one direction, per device
    float8: bool                          # float8 matmuls run faster than bfloat16 ones here
    source: str                           # where the figures come from
    compute_capability: tuple[int, int] | None = None   # NVIDIA only
    shared_memory_per_block: int | None = None           # opt-in bytes per thread block (NVIDIA only)
    devices_per_chip: int = 1


_CUDA_GUIDE = "shared memory: CUDA C++ Programming Guide, Technical Specifications per Compute Capability"
_NVLINK4 = 450 * GIGA  # NVLink 4: 900 GB/s a GPU, both directions together
_NDR = 50 * GIGA       # one 400 Gb/s InfiniBand NDR / ConnectX-7 port per GPU (DGX H100, GCP a3-mega)

CHIPS = (
    Chip("h100", "gpu", ("H100 80GB HBM3", "H100 SXM", "H100"), 84_978_434_048, 989.0 * TERA, 1979.0 * TERA,
         3.35e12, _NVLINK4, _NDR, True,
         "NVIDIA H100 datasheet (SXM5); memory: device_memory_size of the h100_sxm target config (compile/targets.py); "
         f"{_CUDA_GUIDE}", (9, 0), 232_448),
    Chip("h100-pcie", "gpu", ("H100 PCIe",), 80 * 10**9, 756.0 * TERA, 1513.0 * TERA, 2.0e12, 300 * GIGA, 25 * GIGA,
         True, f"NVIDIA H100 datasheet (PCIe; NVLink bridge 600 GB/s); {_CUDA_GUIDE}", (9, 0), 232_448),
    Chip("h200", "gpu", ("H200",), 141_000_000_000, 989.0 * TERA, 1979.0 * TERA, 4.8e12, _NVLINK4, _NDR, True,
         "NVIDIA H200 datasheet (SXM); memory: device_memory_size of the h200_sxm target config (compile/targets.py); "
         f"{_CUDA_GUIDE}", (9, 0), 232_448),
    Chip("gh200", "gpu", ("GH200",), 96 * 10**9, 989.0 * TERA, 1979.0 * TERA, 4.0e12, _NVLINK4, _NDR, True,
         f"NVIDIA GH200 datasheet (96 GB HBM3); {_CUDA_GUIDE}", (9, 0), 232_448),
    Chip("b200", "gpu", ("B200",), 180 * 10**9, 2250.0 * TERA, 4500.0 * TERA, 8.0e12, 900 * GIGA, _NDR, True,
         f"NVIDIA DGX B200 datasheet (per GPU; NVLink 5: 1.8 TB/s); {_CUDA_GUIDE}", (10, 0), 232_448),
    Chip("a100", "gpu", ("A100",), 85_899_345_920, 312.0 * TERA, None, 2.039e12, 300 * GIGA, 25 * GIGA, False,
         "NVIDIA A100 datasheet (SXM4 80GB; NVLink 3: 600 GB/s; 200 Gb/s HDR per GPU); memory: device_memory_size "
         f"of the a100_sxm target config (compile/targets.py); {_CUDA_GUIDE}", (8, 0), 166_912),
    Chip("l40s", "gpu", ("L40S",), 48 * 10**9, 362.0 * TERA, 733.0 * TERA, 864 * GIGA, None, None, True,
         f"NVIDIA L40S datasheet; {_CUDA_GUIDE}", (8, 9), 101_376),
    Chip("l4", "gpu", ("L4",), 24 * 10**9, 121.0 * TERA, 242.0 * TERA, 300 * GIGA, None, None, True,
         f"NVIDIA L4 datasheet; {_CUDA_GUIDE}", (8, 9), 101_376),
    Chip("a10g", "gpu", ("A10G",), 24 * 10**9, 70.0 * TERA, None, 600 * GIGA, None, None, False,
         f"AWS G5 (NVIDIA A10G) specifications; {_CUDA_GUIDE}", (8, 6), 101_376),
    Chip("v100", "gpu", ("V100",), 32 * 10**9, 125.0 * TERA, None, 900 * GIGA, 150 * GIGA, None, False,
         "NVIDIA V100 datasheet (SXM2; float16 tensor cores, no bfloat16; NVLink 2: 300 GB/s)", (7, 0), None),
    Chip("jetson-orin", "gpu", ("Orin",), None, None, None, None, None, None, False, _CUDA_GUIDE, (8, 7), 166_912),
    Chip("rtx-50", "gpu", ("RTX 50",), None, None, None, None, None, None, True, _CUDA_GUIDE, (12, 0), 101_376),
    # TPUs: Cloud TPU's system architecture pages (per chip: bf16 peak, HBM, HBM bandwidth, ICI bandwidth, both
    # directions together). DCN: a host's NIC shared by its chips (v4, v5p: 4 chips; v5e, v6e: 8 (4 on
    # small slices; 8 assumed); v7x: 4 chips); the host NIC figures are the ones Cloud TPU documents for
    # multislice (v4, v5p 200 Gb/s a host; v5e, v6e 4 x 100 Gb/s; v7x 4 x 200 Gb/s), approximate.
    Chip("v4", "tpu", ("TPU v4",), 32 * GIB, 275.0 * TERA, 275.0 * TERA, 1200 * GIGA, 150 * GIGA, 6.25 * GIGA,
         False, "Cloud TPU v4 (2,400 Gb/s ICI a chip); fp8 at the bfloat16 rate (libtpu 0.0.52)", devices_per_chip=1),
    Chip("v5p", "tpu", ("TPU v5p", "TPU v5"), 95 * GIB, 459.0 * TERA, 459.0 * TERA, 2765 * GIGA, 300 * GIGA,
         6.25 * GIGA, False, "Cloud TPU v5p (4,800 Gb/s ICI a chip); fp8 at the bfloat16 rate (libtpu 0.0.52)"),
    Chip("v5e", "tpu", ("TPU v5 lite", "TPU v5e"), 16 * GIB, 197.0 * TERA, 197.0 * TERA, 819 * GIGA, 100 * GIGA,
         6.25 * GIGA, False, "Cloud TPU v5e (1,600 Gb/s ICI a chip); fp8 at the bfloat16 rate (libtpu 0.0.52)"),
    Chip("v6e", "tpu", ("TPU v6 lite", "TPU v6e"), 32 * GIB, 918.0 * TERA, 918.0 * TERA, 1640 * GIGA, 224 * GIGA,
         6.25 * GIGA, False, "Cloud TPU v6e (3,584 Gb/s ICI a chip); fp8 at the bfloat16 rate (libtpu 0.0.52)"),
    Chip("v7x", "tpu", ("TPU7x",), 96 * GIB, 1153.5 * TERA, 2307.0 * TERA, 3685 * GIGA, 300 * GIGA, 12.5 * GIGA,
         True, "Cloud TPU7x (Ironwood): a chip's 192 GiB, 2,307 bf16 and 4,614 fp8 TFLOP/s, 7.37 TB/s HBM and "
         "1.2 TB/s ICI halved per TensorCore, each its own device; libtpu 0.0.52 prices fp8 below bf16 only here "
         "(docs/scale.md, \"float8 matmuls\")", devices_per_chip=2),
)

# A machine whose network differs from its chip's usual one, for the targets that name it (compile/targets.py):
# Google Cloud's A3 High (`compile_topology=a3`, MaxText's A3 rows) shares 1,000 Gbps among its eight H100s.
A3_HIGH = dataclasses.replace(
    next(c for c in CHIPS if c.name == "h100"), name="h100-a3", device_kinds=(),
    network_bytes_per_s=1000 * GIGA / 8 / 8,
    source="the h100 record, but the network: Google Cloud A3 High (a3-highgpu-8g), 1,000 Gbps a machine "
           "(GPUDirect-TCPX) shared by its 8 GPUs (Compute Engine docs, \"Networking and GPU machines\")")
CHIPS = (*CHIPS, A3_HIGH)

_BY_NAME = {c.name: c for c in CHIPS}


class UnknownChip(KeyError):
    """A chip no record describes."""


def by_name(name: str) -> Chip:
    """The record of a chip by its name (a compile target's chip: "h100", "v5p", ...)."""
    if name not in _BY_NAME:
        raise UnknownChip(f"no chip record named {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def by_device_kind(device_kind: str) -> Chip | None:
    """The record whose device_kind pattern is the longest substring of `device_kind` (case-insensitive), or None."""
    kind = device_kind.lower()
    matches = [(len(p), c) for c in CHIPS for p in c.device_kinds if p.lower() in kind]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def by_capability(capability: tuple[int, int]) -> list[Chip]:
    """The records of NVIDIA GPUs with this CUDA compute capability (several chips can share one)."""
    return [c for c in CHIPS if c.compute_capability == tuple(capability)]


# When the GPU is not known: the smallest opt-in limit of the records, so that a kernel compiles on all of them.
DEFAULT_SHARED_MEMORY = min(c.shared_memory_per_block for c in CHIPS if c.shared_memory_per_block)


def shared_memory_per_block(capability: tuple[int, int]) -> int:
    """Opt-in shared memory per thread block of a compute capability; DEFAULT_SHARED_MEMORY if no record says."""
    limits = {c.shared_memory_per_block for c in by_capability(capability) if c.shared_memory_per_block}
    return min(limits) if limits else DEFAULT_SHARED_MEMORY


def float8_tpus() -> list[Chip]:
    """TPU records whose float8 matmuls pay (the others run them at the bfloat16 rate)."""
    return [c for c in CHIPS if c.kind == "tpu" and c.float8]


def gpu_shared_memory(devices) -> int:
    """Shared memory per thread block (opt-in) of the GPUs in `devices` (anything with a compute_capability
    "major.minor"); a safe default if unknown."""
    limits = []
    for device in devices or ():
        try:
            major, minor = (int(x) for x in str(device.compute_capability).split("."))
        except (AttributeError, ValueError):
            continue
        limits.append(shared_memory_per_block((major, minor)))
    return min(limits, default=DEFAULT_SHARED_MEMORY)

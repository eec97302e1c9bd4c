"""What the TPU compiler (libtpu) does differently by version: its version here, whether its memory_analysis()
counts more temporaries than the heap holds, and its refusal of a program that does not fit the chip."""

from __future__ import annotations

import importlib.metadata
import re

# libtpu releases before this one count more temporaries than the program's heap holds: the chip's
# VMEM, and the scanned layers' buffers a second time (docs/scale.md, "The same compiler as MaxText").
LIBTPU_COUNTS_HEAP_FROM = (0, 0, 52)


def version() -> str | None:
    """The installed libtpu's version, or None without one."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def overcounts(libtpu_version: str | None) -> bool:
    """Whether this libtpu's memory_analysis() counts temporaries beyond the heap (0.0.42.1 does)."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", libtpu_version or "")[:3])
    return bool(numbers) and numbers < LIBTPU_COUNTS_HEAP_FROM


def out_of_scalar_memory(error: Exception) -> tuple[str, str] | None:
    """(used, capacity) as libtpu writes them ("1.50M", "1.00M") when the TPU compiler refused a program for its
    scalar memory (SMEM: "Ran out of memory in memory space smem. Used 1.50M of 1.00M smem", or one operand's
    allocation larger than it, in bytes, given here in M), else None. What fills
    SMEM is the Pallas kernels' scalar-prefetch operands, above all the splash kernels' block tables, which grow with
    (tokens per device / block)^2."""
    found = re.search(r"Ran out of memory in memory space smem\. Used ([\d.]+\w?) of ([\d.]+\w?) smem", str(error))
    if found:
        return found.group(1), found.group(2)
    # One operand alone larger than SMEM: "Allocation (size=2097152) would exceed memory (size=1048576) ::
    # #allocation6 [shape = 'u8[2097152]{0}', space=smem, ...]"
    found = re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)[^\n]*?space=smem", str(error))
    if found:
        return tuple(f"{int(n) / 2**20:.2f}M" for n in found.groups())
    return None


def out_of_scoped_vmem(error: Exception) -> tuple[str, str] | None:
    """(size, limit) as libtpu writes them ("29.77M", "16.00M") when the TPU compiler refused a kernel's scoped
    vector-memory (VMEM) allocation ("Scoped allocation with size 29.77M and limit 16.00M exceeded scoped vmem
    limit"), else None. Splash's tiles grow with sa_block_q x sa_block_kv (ulysses at 1M tokens, blocks of 2,048)."""
    found = re.search(r"Scoped allocation with size ([\d.]+\w?) and limit ([\d.]+\w?) exceeded scoped vmem limit",
                      str(error))
    return (found.group(1), found.group(2)) if found else None


def out_of_memory(error: Exception) -> tuple[float, float] | None:
    """(needed, available) GiB when the TPU compiler refused a program for the chip's memory, else None.

    libtpu stops a compile whose temporaries alone exceed the chip's HBM ("RESOURCE_EXHAUSTED: Ran
    out of memory on HBM, the total memory required for HLO temporaries (17.21G) exceeds available
    HBM (15.75G)"): there is no compiled program to measure then, only its figures, in G, or T past 1024 G
    (a 128k-token step's attention scores: "(3.09T)")."""
    match = re.search(r"Ran out of memory in memory space hbm|Ran out of memory on HBM", str(error))
    figures = re.search(r"\(([\d.]+)([GT])\) exceeds available HBM \(([\d.]+)([GT])\)", str(error))
    if not match or not figures:
        return None
    gib = {"G": 1.0, "T": 1024.0}
    return float(figures.group(1)) * gib[figures.group(2)], float(figures.group(3)) * gib[figures.group(4)]

"""Transparent huge pages for the host's large buffers: a CPU train step without a page fault per 4 KiB.

XLA:CPU allocates a step's temporaries (one buffer of several hundred MB for the reference configuration of
docs/performance.md) and its outputs with malloc for every step and frees them after it. glibc serves
allocations this large with a fresh mmap and returns them with munmap, so every step touches its buffers
for the first time again: on the reference configuration ~95,000 page faults per step, each one the kernel
zeroing a 4 KiB page (~0.2 CPU seconds per step, 15% of the step's CPU time). glibc 2.35 and later can
ask the kernel for 2 MiB pages for such allocations (the `glibc.malloc.hugetlb=1` tunable, which
madvises them MADV_HUGEPAGE): one fault then maps 2 MiB where it mapped 4 KiB. With it the same step
takes ~700 faults instead of ~95,000 and 15 to 20% less time, with the same peak memory and bitwise the
same results (docs/performance.md).

glibc reads its tunables from the environment once, when the process starts, so the trainer's entry
points call `reexec_with_hugepages()` before anything else: where the tunable would help and is not
set, the process re-executes itself with the same interpreter, arguments and process id, with
`glibc.malloc.hugetlb=1` added to GLIBC_TUNABLES. It does nothing (and costs nothing) where it cannot
help: not Linux with glibc >= 2.35, transparent huge pages `never` (nothing to ask for) or `always`
(every large mapping gets them already), the tunable already set by the user, or
MAXTRAIN_HOST_HUGEPAGES=0 in the environment (the way to turn it off).

Huge pages make each fresh page cheaper to fault in, but the kernel still zeroes every one: the reference
configuration's step maps, touches and unmaps ~470 MB of temporaries each step (6% of its CPU time in
`clear_page_erms`). The allocations come from XLA's worker threads, whose glibc arenas cannot hold a
buffer this large and map a fresh one each time. `keep_step_buffers(config)` therefore tells glibc, where
the run is on the CPU and its step's buffers are small (`step_buffer_bytes` <= REUSE_MAX_BYTES), to serve
every thread from one arena, never to mmap, and never to give freed memory back (mallopt), so the
second step reuses the first one's pages. The step is 3 to 10% faster; the process keeps its peak
(two steps' temporaries, since a step is dispatched before the last one finishes) plus the one arena's
fragmentation resident: 0.6 to 1.5 GB more on the reference configuration and the default model.
`release_unused()` (malloc_trim) after compiling and after the first step returns what compiling left
behind. It must run before JAX starts its CPU client (threads choose their arena once);
MAXTRAIN_HOST_BUFFER_REUSE=0 turns it off.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "MAXTRAIN_HOST_HUGEPAGES"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library this process runs on, or None where it is not glibc."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, TypeError, ValueError):  # no confstr name (macOS), musl, odd strings
        return None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None where unknown."""
    try:
        with open(THP_ENABLED, encoding="ascii") as f:
            text = f.read()  # "always [madvise] never"
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def hugepage_environment(environ, platform: str, glibc: tuple[int, int] | None, thp: str | None) -> dict | None:
    """The environment to re-execute with so that glibc's malloc madvises huge pages, or None where
    re-executing would change nothing (see the module docstring for the cases)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (environ.get(OPT_OUT) == "0" or platform != "linux" or glibc is None or glibc < (2, 35)
            or thp != "madvise" or TUNABLE in tunables):
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def reexec_with_hugepages() -> None:
    """Re-executes this process with `glibc.malloc.hugetlb=1` where that helps (module docstring); returns
    only where it does not. Call it first thing in an entry point, before JAX starts threads or
    allocates. The process id, arguments, interpreter options and open files stay the same."""
    global _entry_point  # pylint: disable=global-statement
    _entry_point = True  # only the entry points call this: keep_step_buffers may then change malloc
    environ = hugepage_environment(os.environ, sys.platform, glibc_version(), thp_mode())
    if environ is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        os.execve(sys.executable, argv, environ)
    except OSError as error:  # an interpreter that cannot be re-executed: run on without huge pages
        print(f"maxtrain: could not re-execute with {TUNABLE}=1 ({error}); continuing without it", file=sys.stderr)


def describe() -> str:
    """One line for the start-up summary: whether this process' large host buffers get huge pages, and
    whether a step's buffers are kept between steps."""
    return _describe_pages() + "; " + (
        f"step buffers kept between steps ({REUSE_OPT_OUT}=0 turns it off)" if _reuse == "on"
        else f"step buffers mapped afresh each step ({_reuse})")


def _describe_pages() -> str:
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        if item.startswith(TUNABLE + "="):
            return f"host memory: glibc malloc with {item}" + (
                f" (transparent huge pages for large buffers; {OPT_OUT}=0 turns them off)" if item == TUNABLE + "=1"
                else "")
    mode, glibc = thp_mode(), glibc_version()
    if mode == "always":
        return "host memory: transparent huge pages (the kernel's mode is always)"
    why = (f"{OPT_OUT}=0" if os.environ.get(OPT_OUT) == "0" else
           f"transparent huge pages {mode or 'unavailable'}" if mode != "madvise" else
           "not glibc" if glibc is None else "glibc older than 2.35" if glibc < (2, 35) else
           f"not started as python -m maxtrain.train; GLIBC_TUNABLES={TUNABLE}=1 before Python starts does the same")
    return f"host memory: 4 KiB pages ({why})"


# glibc's mallopt parameters (malloc.h), and the largest step `keep_step_buffers` keeps (module docstring)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
REUSE_OPT_OUT = "MAXTRAIN_HOST_BUFFER_REUSE"
REUSE_MAX_BYTES = 2**30
ACCELERATOR_PACKAGES = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
_reuse = "not requested"  # "on", or why not
_entry_point = False  # set by reexec_with_hugepages: this process is the trainer or the benchmark


def step_buffer_bytes(config) -> int:
    """An estimate of one step's temporaries per device: the activations remat_policy=none keeps
    (models.runtime.saved_activation_bytes) and the float32 logits and their gradient."""
    # deferred: maxtrain.models loads JAX (~0.9 s), and this module is imported before JAX starts (reexec_with_hugepages)
    from maxtrain.models import runtime  # pylint: disable=import-outside-toplevel
    tokens = int(config.per_device_batch_size * config.max_target_length)  # a fraction: part of a sequence
    return runtime.saved_activation_bytes(config) + 8 * tokens * config.vocab_size


def reuse_refusal(environ, platform: str, glibc: tuple[int, int] | None, platforms: str, accelerator: bool,
                  step_bytes: int, entry_point: bool = True) -> str | None:
    """Why `keep_step_buffers` leaves malloc as it is, or None where it applies (module docstring)."""
    if environ.get(REUSE_OPT_OUT) == "0":
        return f"{REUSE_OPT_OUT}=0"
    if not entry_point:  # a library caller's process (a test suite) keeps malloc's defaults
        return "not started as python -m maxtrain.train"
    if platform != "linux" or glibc is None:
        return "not glibc"
    if platforms.split(",")[0] not in ("", "cpu") or (not platforms and accelerator):
        return "an accelerator may run the step"
    if step_bytes > REUSE_MAX_BYTES:
        return f"a step of ~{step_bytes / 2**30:.1f} GiB of temporaries, over {REUSE_MAX_BYTES / 2**30:.0f} GiB"
    return None


def keep_step_buffers(config) -> None:
    """Where the run is on the CPU and its step is small, makes glibc's malloc keep a step's freed buffers
    for the next (module docstring). Call it before JAX starts its backend."""
    global _reuse  # pylint: disable=global-statement
    import jax  # pylint: disable=import-outside-toplevel
    accelerator = any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PACKAGES)
    _reuse = reuse_refusal(os.environ, sys.platform, glibc_version(), jax.config.jax_platforms or "", accelerator,
                           step_buffer_bytes(config), _entry_point) or "on"
    if _reuse == "on":
        libc = ctypes.CDLL(None)
        if not (libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1)):
            _reuse = "mallopt refused"


def release_unused() -> None:
    """Returns the freed memory malloc holds to the system (what compiling the step left behind), where
    `keep_step_buffers` stopped it from doing so itself."""
    if _reuse == "on":
        ctypes.CDLL(None).malloc_trim(0)

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
"""

from __future__ import annotations

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
    """One line for the start-up summary: whether this process' large host buffers get huge pages."""
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

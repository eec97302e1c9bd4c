"""Run by tests/training/test_host_memory.py as a program: re-executes itself the way the trainer's entry points do,
then mallocs and touches a 64 MiB buffer and prints one JSON line: its process id, arguments,
GLIBC_TUNABLES, and how much of its memory the kernel backs with transparent huge pages."""

from __future__ import annotations

import ctypes
import json
import os
import sys

from maxtrain.training import host_memory

host_memory.reexec_with_hugepages()


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


# malloc itself, as XLA's allocator calls it (numpy would madvise its large arrays itself); glibc serves an
# allocation this large with mmap.
SIZE = 64 * 2**20
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
buffer = libc.malloc(SIZE)
ctypes.memset(buffer, 1, SIZE)
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "tunables": os.environ.get("GLIBC_TUNABLES"),
                  "anon_huge_kib": anon_huge_kib(), "describe": host_memory.describe()}), flush=True)

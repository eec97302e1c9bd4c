"""Run by tests/training/test_host_memory.py as a program, as the trainer starts: re-executes itself, loads a small
config, calls host_memory.keep_step_buffers, then does from a new thread what XLA's CPU client does for
each step's temporaries: malloc a large buffer, write every page, free it, twice. Prints one JSON line:
the summary's host-memory line and the page faults of the second pass."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import threading

from maxtrain.training import host_memory

host_memory.reexec_with_hugepages()

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BASE_YML, TINY  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.config import load_config, with_overrides  # noqa: E402  pylint: disable=wrong-import-position

host_memory.keep_step_buffers(load_config([BASE_YML, *with_overrides(TINY)]))

SIZE = 256 * 2**20
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []


def one_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(SIZE)
    ctypes.memset(buffer, 1, SIZE)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


def worker():
    one_pass()
    one_pass()


thread = threading.Thread(target=worker)
thread.start()
thread.join()
print(json.dumps({"reuse": host_memory.describe(), "first_pass_faults": faults[0], "second_pass_faults": faults[1]}))

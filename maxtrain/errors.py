"""The user's mistakes, and the one place that turns them into `prog: error: ...` and exit status 2.

Every error the project raises for something a user gave (a config key or value, a path, data, a
tokenizer, a checkpoint, the process layout) derives from UserError. The entry points run their
main function through `run_cli`, which prints such an error as one line (`maxtrain: error: ...`)
and exits 2. Anything else is a bug and keeps its traceback.

No JAX and nothing else of maxtrain is imported here: every module may import this one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

EXIT_STATUS = 2


class UserError(Exception):
    """Something the user gave is wrong; the message names it and says what to do."""


class ConfigError(UserError, ValueError):
    """A bad config file, key or value. The message names the problem and the fix."""


def run_cli(prog: str, main: Callable, argv: list[str] | None = None, hard_exit: tuple[type, ...] = (),
            usage: str | Callable[[], str] | None = None):
    """Runs `main(argv)`; a UserError becomes one line on stderr and exit status 2.

    `hard_exit`: error types after which background threads (a failed checkpoint save's writers) may
    still be running and would only add tracebacks on the way out; the process ends at once.
    `usage`: the command's help (text, or a function that makes it), printed for -h or --help (exit 0).
    Returns main's result.
    """
    argv = sys.argv[1:] if argv is None else argv
    if usage is not None and any(arg in ("-h", "--help") for arg in argv):
        print((usage() if callable(usage) else usage).strip("\n"), flush=True)
        sys.exit(0)
    try:
        return main(argv)
    except UserError as error:
        message = str(error).strip() or type(error).__name__
        if isinstance(error, hard_exit):
            _print_last_and_exit(f"{prog}: error: {message}\n")
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STATUS)


def _print_last_and_exit(line: str) -> None:
    """Writes `line` to stderr as the process' last output and ends the process at once.

    Background threads (a failed save's TensorStore callbacks) can print tracebacks to stderr at any
    moment, even between a message and its newline; from here on stderr goes to /dev/null for them,
    and the line is written to the original stderr in one write, once no thread is still inside a
    write to it (a write blocked on a full pipe would otherwise land after the line)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        original = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        _wait_for_writes_to_stderr()
        os.write(original, line.encode("utf-8", "replace"))
    except OSError:  # no usable stderr: still end the process
        pass
    os._exit(EXIT_STATUS)  # pylint: disable=protected-access


# write and writev on x86-64 (1, 20) and arm64 (64, 66), as /proc/<pid>/task/<tid>/syscall shows them.
_WRITE_SYSCALLS = {"1", "20", "64", "66"}


def _threads_writing_to_stderr() -> int | None:
    """How many other threads are inside a write to fd 2 now; None where /proc cannot tell (not Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    me, busy = str(threading.get_native_id()), 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/syscall", encoding="ascii") as f:
                fields = f.read().split()
        except OSError:  # the thread ended, or /proc/*/syscall is not readable here
            continue
        if len(fields) > 1 and fields[0] in _WRITE_SYSCALLS and fields[1] == "0x2":
            busy += 1
    return busy


def _wait_for_writes_to_stderr(timeout: float = 2.0) -> None:
    """Waits (at most `timeout` seconds) until no other thread is seen blocked in a write to fd 2 twice
    in a row, then 50 ms more: a write woken from a full pipe runs when the scheduler lets it, and
    shows as running, not as a write. fd 2 is /dev/null by now, so new writes go there."""
    deadline, quiet = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and quiet < 2:
        busy = _threads_writing_to_stderr()
        quiet = quiet + 1 if not busy else 0
        time.sleep(0.005)
    time.sleep(0.05)

"""The user's mistakes, and the one place that turns them into `prog: error: ...` and exit status 2.

Every error the project raises for something a user gave (a config key or value, a path, data, a
tokenizer, a checkpoint, the process layout) derives from UserError. The entry points run their
main function through `run_cli`, which prints such an error as one line (`maxtrain: error: ...`)
and exits 2. Anything else is a bug and keeps its traceback.

No JAX and nothing else of maxtrain is imported here: every module may import this one.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
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


class ToolError(UserError):
    """A bad argument or input of a user tool (scripts/, end_to_end/); the message names it and the fix."""


class PathError(UserError):
    """A path the user gave cannot be read or written; the message names it, the problem and the fix."""


class MissingPackage(UserError):
    """An optional package is not installed; the message names the extra (or command) that installs it."""


# Optional packages -> the extra of pyproject.toml's [project.optional-dependencies] that installs them
# (pyproject.toml owns the lists; tests/commands/test_scripts_errors.py checks that this table agrees with it).
EXTRAS = {"pyarrow": "data", "zstandard": "data", "gcsfs": "gcs", "wandb": "wandb", "xprof": "profile",
          "torch": "hf", "transformers": "hf", "safetensors": "hf", "peft": "post", "tokamax": "gpu"}


def install_hint(package: str) -> str:
    """`pip install 'maxtrain[hf]'` for a package of an extra (`pip install <package>` for any other)."""
    return f"pip install 'maxtrain[{EXTRAS[package]}]'" if package in EXTRAS else f"pip install {package}"


def require(module: str, purpose: str, install: str | None = None):
    """Imports and returns `module`, or raises MissingPackage: "<purpose> needs <package>: <install>".
    `install` defaults to the extra that holds the package (EXTRAS)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise MissingPackage(f"{purpose} needs the {package} package: "
                             f"{install or install_hint(package)}") from None


def _blocking_file(path: str) -> str | None:
    """The nearest existing ancestor of `path` that is a file (not a directory), if one is in the way."""
    path = os.path.abspath(path)
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
        if os.path.exists(path):
            return None if os.path.isdir(path) else path


def describe(error: OSError, label: str = "") -> str:
    """An OSError in words, naming its path: `--output-dir /x/y: /x is a file, not a directory; choose a
    directory`. No errno number, no Python exception name. `label` (e.g. "--output-dir") comes first."""
    path = error.filename if error.filename is not None else ""
    where = f"{label} {path}".strip() if path else label
    code = error.errno
    if code is None:  # raised with a message of its own (storage.StorageError, ...)
        return f"{where}: {error}" if where and str(path) not in str(error) else str(error)
    blocking = _blocking_file(str(path)) if path else None
    if code == errno.ENOENT:
        problem = "does not exist; check the path"
    elif code in (errno.ENOTDIR, errno.EEXIST) and blocking:
        problem = f"cannot be made: {blocking} is a file, not a directory; choose a path inside a directory"
    elif code == errno.EEXIST and path and os.path.isfile(path):
        problem = "is a file, where a directory is needed; choose a directory"
    elif code == errno.EEXIST:
        problem = "already exists; choose another path or remove it"
    elif code == errno.ENOTDIR:
        problem = "is a file, where a directory is needed; choose a directory"
    elif code == errno.EISDIR:
        problem = "is a directory, where a file is needed; give a file's path"
    elif code in (errno.EACCES, errno.EPERM):
        problem = "cannot be used: no permission; choose a path you may write, or change its permissions"
    elif code == errno.ENOSPC:
        problem = "cannot be written: no space left on its disk; free some space or choose another disk"
    elif code == errno.EROFS:
        problem = "cannot be written: its file system is read-only; choose a writable place"
    elif code == getattr(errno, "EDQUOT", None):
        problem = "cannot be written: the disk quota is used up; free some space or choose another disk"
    elif code == errno.ENAMETOOLONG:
        problem = "has a name that is too long; choose a shorter path"
    else:
        problem = (error.strerror or str(error)).lower()
    return f"{where}: {problem}" if where else problem


@contextlib.contextmanager
def user_paths(label: str = ""):
    """Inside, an OSError (a path the user gave: missing, a file in the way, not writable, a full disk)
    becomes PathError with `describe`'s one line. Wrap only code whose files the user chose."""
    try:
        yield
    except OSError as error:
        raise PathError(describe(error, label)) from None


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
    write to it (a write blocked on a full pipe would otherwise land after the line). A thread may have
    written a traceback's line and not yet its newline (Python writes them apart), so the line starts
    with a newline of its own: the message is always a line by itself, the last one."""
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
        os.write(original, ("\n" + line).encode("utf-8", "replace"))
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

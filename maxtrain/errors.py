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
from typing import Callable

EXIT_STATUS = 2


class UserError(Exception):
    """Something the user gave is wrong; the message names it and says what to do."""


class ConfigError(UserError, ValueError):
    """A bad config file, key or value. The message names the problem and the fix."""


def run_cli(prog: str, main: Callable, argv: list[str] | None = None, hard_exit: tuple[type, ...] = ()):
    """Runs `main(argv)`; a UserError becomes one line on stderr and exit status 2.

    `hard_exit`: error types after which background threads (a failed checkpoint save's writers) may
    still be running and would only add tracebacks on the way out; the process ends at once.
    Returns main's result.
    """
    try:
        return main(sys.argv[1:] if argv is None else argv)
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
    and the line is written to the original stderr in one write."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        original = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.write(original, line.encode("utf-8", "replace"))
    except OSError:  # no usable stderr: still end the process
        pass
    os._exit(EXIT_STATUS)  # pylint: disable=protected-access

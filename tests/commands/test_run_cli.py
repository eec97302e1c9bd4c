"""errors.run_cli: a user error is one line on stderr and exit status 2; after a hard-exit error
(a failed checkpoint save) that line is the last output even while background threads keep printing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import os, sys, threading, time
    from maxtrain.errors import UserError, run_cli

    class SaveFailed(UserError):
        pass

    def noisy():  # a background writer that keeps printing tracebacks, as a failed save's threads do
        while True:  # os.write runs without the GIL, as a C++ thread's writes would
            os.write(2, b"Traceback (most recent call last):\\n  RuntimeError: Event loop is closed\\n")

    class LateWriter:  # stdout whose flush lets another writer print first: the window a thread's
        def __init__(self, stream):  # traceback can fall into while the process is on its way out
            self.stream, self.failed = stream, False
        def write(self, text):
            return self.stream.write(text)
        def flush(self):
            self.stream.flush()
            if self.failed:
                os.write(2, b"Traceback (most recent call last):\\n  RuntimeError: Event loop is closed\\n")

    def main(argv):
        print("training", flush=True)
        if argv == ["plain"]:
            raise UserError("bad value")
        if argv == ["late"]:
            sys.stdout = LateWriter(sys.stdout)
            sys.stdout.failed = True
        elif argv == ["partial"]:  # a traceback's line written, its newline not yet (Python writes them apart)
            os.write(2, b"    raise RuntimeError('Event loop is closed')")
        else:
            threading.Thread(target=noisy, daemon=True).start()
            time.sleep(0.05)
        raise SaveFailed("saving checkpoint 100 failed: File too large")

    run_cli("prog", main, hard_exit=(SaveFailed,))
""")


def run(*args):
    return subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True, timeout=60)


def test_a_user_error_is_one_line_and_exit_status_2():
    result = run("plain")
    assert result.returncode == 2
    assert result.stdout == "training\n"
    assert result.stderr == "prog: error: bad value\n"


def test_a_hard_exit_error_is_the_last_line_even_with_threads_printing():
    for _ in range(20):  # the background thread writes constantly: any interleaving would show
        result = run()
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stdout == "training\n"
        assert result.stderr.endswith("\nprog: error: saving checkpoint 100 failed: File too large\n"), result.stderr[-500:]


def test_a_hard_exit_error_is_the_last_line_even_when_output_arrives_on_the_way_out():
    result = run("late")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == "training\n"
    assert result.stderr.endswith("\nprog: error: saving checkpoint 100 failed: File too large\n"), result.stderr[-500:]


def test_a_hard_exit_error_is_a_line_of_its_own_after_another_threads_unfinished_line():
    result = run("partial")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.endswith("closed')\nprog: error: saving checkpoint 100 failed: File too large\n"), \
        result.stderr[-500:]

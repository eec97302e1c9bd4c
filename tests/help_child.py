"""Runs many commands' `--help` in this one process and prints what each said, as JSON (tests/test_house.py).

    python tests/help_child.py CWD_FOR_MODULES  # reads a JSON list of argv lists on stdin

Each argv is `["-m", "maxtrain.train"]` or `["scripts/x.py"]`, run as `python ARGV --help` would run it (runpy,
`__main__`), with its stdout captured and its exit status kept. One process pays Python's and JAX's start-up
once for every command (about 5 s each on 2 cores as separate processes); the test still runs it as a real
process of its own, so nothing a command does at import reaches the test process.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answer(argv: list[str], module_cwd: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    module = argv[0] == "-m"
    os.chdir(module_cwd if module else REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if module:
                sys.argv = [argv[1], "--help"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                path = os.path.join(REPO, argv[0])
                sys.argv = [path, "--help"]
                sys.path.insert(0, os.path.dirname(path))
                runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # pylint: disable=broad-except
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"argv": argv, "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    commands = json.load(sys.stdin)
    print(json.dumps([answer(argv, sys.argv[1]) for argv in commands]))

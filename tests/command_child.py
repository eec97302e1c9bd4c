"""Runs many commands in this one process, each as `python ARGV` would run it, and prints what each said, as JSON.

    python tests/command_child.py CWD_FOR_MODULES  # reads a JSON list of runs on stdin

Each run is {"argv": [...], "env": {...}, "hide": [...]}: argv is `["-m", "maxtrain.train", ...]` or
`["scripts/x.py", ...]`, run as `__main__` (runpy) with its stdout and stderr captured and its exit status kept;
env holds environment variables set for that run only; hide names modules that fail to import during it. One
process pays Python's and JAX's start-up once for every run (about 5 s each on 2 cores as separate processes);
the tests still run it as a real process of their own, so nothing a command does at import reaches the test
process, and no test loads a script itself (tests/house/test_house.py). Used by tests/house/test_house.py (every command's
--help), tests/commands/test_scripts_errors.py and tests/test_bad_inputs/ (the tools' one-line errors).
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answer(run: dict, module_cwd: str) -> dict:
    argv = run["argv"]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    hidden = {name: sys.modules.get(name) for name in run.get("hide", ())}
    module = argv[0] == "-m"
    os.chdir(module_cwd if module else REPO)
    os.environ.update(run.get("env") or {})
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if module:
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                path = os.path.join(REPO, argv[0])
                sys.argv = [path, *argv[1:]]
                sys.path.insert(0, os.path.dirname(path))
                runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # pylint: disable=broad-except
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        for name, module_object in hidden.items():
            if module_object is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module_object
    return {"argv": argv, "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    runs = json.load(sys.stdin)
    print(json.dumps([answer(run, sys.argv[1]) for run in runs]))

"""The house's figures (docs/architecture.md, "Measured"), read from the source as text: how many functions take
the whole config, which modules are over 500 lines, how many families are folders, and which shared modules of
models/ one family alone imports (tests/house/test_house.py wants none).

    python scripts/house_figures.py                # this checkout's working tree
    python scripts/house_figures.py --rev 8b7329f  # another commit, read with git (nothing checked out)

Reads files with git and Python's ast; imports nothing of maxtrain's but its error path.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from maxtrain.errors import ToolError, run_cli  # noqa: E402  pylint: disable=wrong-import-position

FAMILIES = "maxtrain/models/families/"


def package_files(rev: str | None) -> dict[str, str]:
    """{path: text} of maxtrain/'s Python files at `rev` (None: the working tree)."""
    command = ["ls-files"] if rev is None else ["ls-tree", "-r", "--name-only", rev]
    listed = subprocess.run(["git", "-C", REPO, *command, "maxtrain"], capture_output=True, text=True)
    if listed.returncode:
        raise ToolError(f"--rev {rev}: {listed.stderr.strip() or 'not a commit of this repository'}")
    out = {}
    for path in listed.stdout.split():
        if not path.endswith(".py"):
            continue
        if rev is None:
            if os.path.isfile(os.path.join(REPO, path)):
                with open(os.path.join(REPO, path), encoding="utf-8") as f:
                    out[path] = f.read()
        else:
            out[path] = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{path}"], capture_output=True,
                                       text=True, check=True).stdout
    return out


def family_of(path: str) -> str | None:
    """The family a file of models/families/ belongs to: <name>.py (a module) or <name>/... (a folder)."""
    parts = path[len(FAMILIES):].split("/") if path.startswith(FAMILIES) else []
    if not parts or parts == ["__init__.py"]:
        return None
    return parts[0][:-3] if len(parts) == 1 else parts[0]


def imported(tree: ast.Module) -> set[str]:
    """The maxtrain modules a file imports (`from a.b import c` counts a.b and a.b.c)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maxtrain"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("maxtrain")}
    return out


def figures(files: dict[str, str]) -> dict:
    functions = taking_config = 0
    long_modules, users = [], {}
    modules = {p[:-3].removesuffix("/__init__").replace("/", "."): p for p in files}
    for path, text in files.items():
        tree = ast.parse(text)
        if text.count("\n") > 500:
            long_modules.append(f"{path} ({text.count(chr(10))})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions += 1
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                taking_config += any(a.arg == "config" for a in args)
        who = family_of(path) or path
        for module in imported(tree) & set(modules):
            if family_of(modules[module]) is None and module != "maxtrain.models.families":
                users.setdefault(module, set()).add(who)
    families = sorted({family_of(p) for p in files} - {None})
    folders = sorted({family_of(p) for p in files if p.startswith(FAMILIES) and p.count("/") > 3} - {None})
    single = sorted(m for m, who in users.items() if m.startswith("maxtrain.models.") and len(who) == 1
                    and next(iter(who)) in families)
    return {"functions": functions, "taking_config": taking_config, "long_modules": long_modules,
            "families": families, "folders": folders, "single": single}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="house_figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a commit to read instead of the working tree")
    args = parser.parse_args(argv)
    f = figures(package_files(args.rev))
    print(f"functions taking `config`: {f['taking_config']} of {f['functions']} (maxtrain/)")
    print(f"modules over 500 lines: {len(f['long_modules'])} {' '.join(f['long_modules'])}".rstrip())
    print(f"families: {len(f['families'])}, as folders: {len(f['folders'])}")
    print(f"shared modules of models/ one family alone imports: {len(f['single'])} {' '.join(f['single'])}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("house_figures", main))

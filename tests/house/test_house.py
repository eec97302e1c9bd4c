"""The house's rules (docs/architecture.md), each checked so that breaking it fails CI:

- the layers and forbidden imports of .importlinter (import-linter), and no import circle at any depth;
- no function-level import of maxtrain's own modules unless a comment says what it defers;
- no module reaches for another module's `_private` name (the package, scripts/ and end_to_end/);
- one owner per fact: the family registry, the compile targets, `load_model`, the attention
  implementation resolved once (in the builder), the config loaded once per command;
- every package's `__init__` says what it owns and what it may import; train.main fits 80 lines;
- no test loads a script by its path (tests import the package, and run scripts as commands).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain.config import registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "maxtrain")
COMMANDS = ("train", "train_compile", "decode", "evaluate", "check_logits", "viz", "inspect_data", "inspect_checkpoint")
# The package modules that hold a script's logic (scripts/gpu_report.py, benchmark.py, plan.py): they load the
# configs they build and measure, as a command does.
SCRIPT_LOGIC = ("maxtrain/gpu_check/", "maxtrain/training/benchmark.py", "maxtrain/training/layout_plan.py",
                "maxtrain/training/rl_plan.py")
SUBPACKAGES = ("config", "parallel", "models", "kernels", "data", "training", "checkpointing", "compile",
               "observability", "evals", "gpu_check")


def python_files(*roots: str):
    for root in roots:
        for directory, _, names in os.walk(os.path.join(REPO, root)):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(directory, name)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def imported_modules(node, current: str) -> list[str]:
    """The maxtrain modules an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("maxtrain")]
    base = node.module or ""
    if node.level:
        base = ".".join(current.split(".")[:-node.level] + ([base] if base else []))
    return [base] if base.startswith("maxtrain") else []


# ----------------------------------------------------------------------------------------------
# Imports


def test_import_linter_contracts_hold():
    """.importlinter's layers, forbidden imports and acyclic siblings (every package, every depth)."""
    lint = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(lint):
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    done = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _function_level_imports(tree: ast.Module, current: str):
    for outer in ast.walk(tree):
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(outer):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and imported_modules(node, current):
                    yield node


def test_function_level_imports_of_our_modules_say_what_they_defer():
    """A function-level import of maxtrain's own modules hides the layers; allowed only where it defers an
    optional dependency or a measured start-up cost, and the line (or the one above) says `deferred`."""
    offenders = []
    for path in python_files("maxtrain"):
        lines = open(path, encoding="utf-8").read().splitlines()
        for node in _function_level_imports(parse(path), module_name(path)):
            context = " ".join(lines[max(0, node.lineno - 2):node.end_lineno])
            if "deferred" not in context:
                offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not offenders, "function-level imports of maxtrain's modules without a `deferred: why` comment:\n" + \
        "\n".join(offenders)


def test_no_module_uses_another_modules_private_names():
    offenders = []
    for path in python_files("maxtrain", "scripts", "end_to_end"):
        tree = parse(path)
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("maxtrain"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: imports {node.module}.{a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("maxtrain"):
                        aliases[a.asname or a.name.split(".")[0]] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offenders, "uses of another module's private names:\n" + "\n".join(offenders)


def test_every_package_says_what_it_owns_and_may_import():
    for name in SUBPACKAGES:
        tree = parse(os.path.join(PACKAGE, name, "__init__.py"))
        doc = ast.get_docstring(tree) or ""
        assert len(doc.splitlines()) >= 3 and "import" in doc.lower(), f"maxtrain/{name}/__init__.py: say what it " \
                                                                       "owns and what it may import"
    top = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")} - {"__init__"}
    assert top == set(COMMANDS) | {"errors", "storage"}, "only the commands and the base modules sit at the top"


def test_train_main_reads_in_at_most_80_lines():
    tree = parse(os.path.join(PACKAGE, "train.py"))
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 80


# ----------------------------------------------------------------------------------------------
# One owner per fact


def string_constants(tree: ast.AST):
    """The string constants of a module, its docstrings left out."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def literal_collections(tree: ast.AST):
    """Tuples, lists, sets and dict keys written as literals, with their string elements."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            yield node, [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        elif isinstance(node, ast.Dict):
            yield node, [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def second_owners(names: set[str], owner: str, at_least: int = 2) -> list[str]:
    """Places outside `owner` that list `at_least` of `names` in one literal: a second list of the same fact."""
    found = []
    for path in python_files("maxtrain"):
        if os.path.relpath(path, REPO) == owner:
            continue
        for node, values in literal_collections(parse(path)):
            if len(set(values) & names) >= at_least:
                found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {sorted(set(values) & names)}")
    return found


def test_the_family_registry_is_the_one_list_of_families():
    import yaml  # pylint: disable=import-outside-toplevel

    from maxtrain.models.families import FAMILIES  # pylint: disable=import-outside-toplevel

    names = set(registry.FAMILIES)
    assert set(config_lib.table()["decoder_block"].allowed.exact) == names  # base.yml's choices read it
    with open(BASE_YML, encoding="utf-8") as f:
        line = next(l for l in f if l.startswith("decoder_block:"))
    assert "{$families}" in line, "base.yml's decoder_block lists no families of its own"
    assert set(FAMILIES) == names
    for name, model in FAMILIES.items():
        assert model.row is registry.FAMILIES[name]
        module = importlib.import_module(f"maxtrain.models.families.{name}")
        for attribute in ("DECODER_BLOCK", "HF_MODEL_TYPES", "HF_ARCHITECTURE"):
            assert not hasattr(module, attribute), f"{name}.{attribute}: the registry owns it"
    assert config_lib.MOE_FAMILIES == tuple(n for n, f in registry.FAMILIES.items() if f.moe)
    for preset in config_lib.preset_names():  # every preset names a registered family
        with open(os.path.join(config_lib.packaged_configs_dir(), "models", f"{preset}.yml"), encoding="utf-8") as f:
            block = (yaml.safe_load(f) or {}).get("decoder_block", config_lib.defaults()["decoder_block"])
        assert block in names, f"preset {preset}: decoder_block={block}"
        if registry.FAMILIES[block].moe is False:
            assert config_lib.load_config([BASE_YML, f"model_name={preset}"]).num_experts == 1
    types = [t for f in registry.FAMILIES.values() for t in f.hf_model_types]
    assert len(types) == len(set(types)), "one family per Hugging Face model_type"
    assert not second_owners(names, "maxtrain/config/registry.py"), second_owners(names, "maxtrain/config/registry.py")


def test_every_registered_task_is_defined_and_no_other():
    from maxtrain.evals import tasks  # pylint: disable=import-outside-toplevel

    assert set(tasks.SPECS) == set(registry.EVAL_TASKS) and set(tasks.QUESTIONS) <= set(registry.EVAL_TASKS)


def test_the_measured_attention_speeds_have_one_table():
    """config/attention_speeds.MEASURED is read by the attention choice and the step-time prediction; no other
    module writes a measured row (Row("sm90", ...))."""
    from maxtrain.models.attention import kernel_choice  # pylint: disable=import-outside-toplevel

    owner = "maxtrain/config/attention_speeds.py"
    for path in python_files("maxtrain", "scripts"):
        if os.path.relpath(path, REPO) != owner:
            rows = [n.lineno for n in ast.walk(parse(path)) if isinstance(n, ast.Call)
                    and getattr(n.func, "attr", getattr(n.func, "id", "")) == "Row" and n.args
                    and isinstance(n.args[0], ast.Constant) and str(n.args[0].value).startswith("sm")]
            assert not rows, f"{os.path.relpath(path, REPO)}:{rows}: a measured attention row outside {owner}"
    assert not hasattr(kernel_choice, "MEASURED")


def test_the_compile_targets_have_one_table():
    from maxtrain.compile import targets  # pylint: disable=import-outside-toplevel

    chips = set(targets.TPU_CHIPS) | set(targets.GPU_TARGET_FILES)
    assert {"v5e", "v5p", "h100", "h200", "a100"} <= chips
    owner = "maxtrain/compile/targets.py"
    assert not second_owners(chips, owner), second_owners(chips, owner)
    files = sorted(os.listdir(os.path.join(PACKAGE, "compile", "gpu_targets")))
    assert files == sorted(targets.GPU_TARGET_FILES.values())
    for path in python_files("maxtrain", "scripts"):  # the GPU descriptions are read through the table only
        if os.path.relpath(path, REPO) != owner:
            assert not any("gpu_targets" in n.value for n in string_constants(parse(path))), path


def dotted(node) -> str:
    """`a.b.c` for an attribute chain, `f` for a name, "" otherwise."""
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def calls_of(tree: ast.AST) -> set[str]:
    """Names of the functions called (`f(...)` -> "f", `x.y.f(...)` -> "f" and "y.f")."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            parts = name.split(".")
            out.update({parts[-1], ".".join(parts[-2:])})
    return out


def test_the_tools_load_a_trained_model_one_way():
    """decode, evaluate, check_logits and viz call builder.load_model; nothing else of the package reads a
    checkpoint's params for a model, builds a mesh for it or resolves a runtime beside it."""
    for tool in ("decode", "evaluate", "check_logits", "viz"):
        called = calls_of(parse(os.path.join(PACKAGE, f"{tool}.py")))
        assert "load_model" in called, tool
        assert not called & {"load_params", "create_mesh", "Runtime.from_config", "runtime", "abstract_params"}, tool
    for path in python_files("maxtrain"):
        rel = os.path.relpath(path, REPO)
        if rel not in ("maxtrain/training/builder.py",) and not rel.startswith("maxtrain/checkpointing/"):
            assert "load_params" not in calls_of(parse(path)), rel


def test_the_attention_implementation_is_resolved_once_in_the_builder(monkeypatch):
    from maxtrain.models import attention  # pylint: disable=import-outside-toplevel
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    for path in python_files("maxtrain"):  # who may resolve it
        rel = os.path.relpath(path, REPO)
        called = calls_of(parse(path))
        if rel != "maxtrain/models/runtime.py":
            assert "resolve_implementation" not in called, rel
        if rel != "maxtrain/training/builder.py":
            assert "Runtime.from_config" not in called, rel
    calls = []
    real = attention.resolve_implementation
    monkeypatch.setattr(attention, "resolve_implementation", lambda *a, **k: calls.append(a) or real(*a, **k))
    run = builder.build(config_lib.load_config([BASE_YML, *TINY, "dataset_type=synthetic",
                                                "ici_context_parallelism=2"]))
    assert len(calls) == 1 and run.rt.attention == "dot_product"
    assert f"attention {run.rt.attention}" in builder.summarize(run, run.compile(), 0.0)  # printed


def test_the_config_is_loaded_once_per_command():
    """Each command loads its config once (builder.load_config or config.load_config); nothing below the
    commands loads one but the scripts' logic (SCRIPT_LOGIC: a script's run, as a command's, loads the configs it
    measures)."""
    for command in COMMANDS:
        called = [n for n in ast.walk(parse(os.path.join(PACKAGE, f"{command}.py")))
                  if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "load_config"]
        assert len(called) <= 1, command
    for path in python_files("maxtrain"):
        rel = os.path.relpath(path, REPO)
        if rel.startswith(("maxtrain/config/", "maxtrain/training/builder.py", *SCRIPT_LOGIC)) or \
                rel.removeprefix("maxtrain/").removesuffix(".py") in COMMANDS:
            continue
        assert "load_config" not in calls_of(parse(path)), rel


def test_train_loads_its_config_once(tmp_path, monkeypatch):
    from maxtrain import train  # pylint: disable=import-outside-toplevel
    from maxtrain.config import loading  # pylint: disable=import-outside-toplevel

    calls = []
    real = loading.load_config
    counted = lambda *a, **k: calls.append(a) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(loading, "load_config", counted)
    monkeypatch.setattr(config_lib, "load_config", counted)
    result = train.main([BASE_YML, *TINY, "dataset_type=synthetic", "steps=1", f"base_output_directory={tmp_path}",
                         "run_name=once", "enable_checkpointing=false"])
    assert len(calls) == 1 and result.state is not None


# ----------------------------------------------------------------------------------------------
# Every command answers --help


SCRIPTS = sorted(os.path.relpath(p, REPO) for p in python_files("scripts", "end_to_end")
                 if os.path.basename(p) not in ("common.py", "__init__.py"))


def test_every_command_answers_help(tmp_path):
    """`python CMD --help` for every command: exit 0 and a usage text, and the maxtrain commands name base.yml and
    the settings they read (run from another directory, so the packaged configs are found). All in one child
    process (tests/command_child.py: one start-up of Python and JAX instead of one per command)."""
    commands = [["-m", f"maxtrain.{c}", "--help"] for c in COMMANDS] + [[s, "--help"] for s in SCRIPTS]
    # MAXTRAIN_HUGEPAGES=0: an entry point that re-executes itself for huge pages would re-run the child
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MAXTRAIN_HOST_HUGEPAGES": "0"}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "command_child.py"), str(tmp_path)],
                          input=json.dumps([{"argv": c} for c in commands]), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    assert [a["argv"] for a in answers] == commands
    failures = []
    for a in answers:
        name, text = a["argv"][-2], a["stdout"]
        if a["returncode"] != 0:
            failures.append(f"{name}: exit {a['returncode']}: {a['stderr'][-1500:]}")
        elif not ("usage" in text.lower() or "python" in text):
            failures.append(f"{name}: no usage text: {text[:500]!r}")
        elif "error" in text.lower().split("\n")[0]:
            failures.append(f"{name}: its first line is an error: {text[:300]!r}")
        elif a["argv"][0] == "-m" and name not in ("maxtrain.check_logits", "maxtrain.inspect_checkpoint") and \
                not ("base.yml" in text and "Settings it reads most" in text):
            failures.append(f"{name}: the help does not name base.yml and the settings it reads: {text[-800:]!r}")
    assert not failures, "\n".join(failures)

# --------------------------------------------------------------------------------------------
# The family contract (models/contract.py): what a family is, written down once
# --------------------------------------------------------------------------------------------


def _imported_modules(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


FAMILIES_DIR = os.path.join(REPO, "maxtrain", "models", "families")


def family_imports(name: str) -> set[str]:
    """The modules a family's folder (models/families/<name>/) imports, its own modules left out."""
    own = f"maxtrain.models.families.{name}"
    return {m for path in python_files(os.path.join("maxtrain", "models", "families", name))
            for m in _imported_modules(path) if m != own and not m.startswith(own + ".")}


def test_a_family_is_one_folder_that_imports_no_other_family():
    """Each family is one folder, models/families/<name>/ (its module and what only it uses); what families
    share lives in models/ (standard_layers, blocks, moe, hf, ...), never in another family's folder."""
    from maxtrain.config import registry  # pylint: disable=import-outside-toplevel

    assert sorted(d for d in os.listdir(FAMILIES_DIR) if os.path.isdir(os.path.join(FAMILIES_DIR, d))
                  and d != "__pycache__") == sorted(registry.FAMILIES)
    assert sorted(f for f in os.listdir(FAMILIES_DIR) if f.endswith(".py")) == ["__init__.py"]
    for name in registry.FAMILIES:
        others = sorted(m for m in family_imports(name) if m.startswith("maxtrain.models.families"))
        assert not others, f"models/families/{name}/ imports {others}: move what it shares into models/"


def test_a_shared_module_used_by_one_family_lives_in_that_family():
    """A module of models/ that exactly one family imports, and nothing else in maxtrain does, is that family's
    own: it moves into models/families/<name>/ (so that a family touches its folder and nothing else). The vision
    towers of models/vision/ are blocks by design (docs: DESIGN.md, "towers are blocks"): a tower several families'
    released checkpoints share (Qwen3-VL's and Qwen3.5's) stays there while the first of them reads it."""
    from maxtrain.config import registry  # pylint: disable=import-outside-toplevel

    users: dict[str, set[str]] = {}
    for name in registry.FAMILIES:
        for m in family_imports(name):
            users.setdefault(m, set()).add(name)
    outside = set()
    for path in python_files("maxtrain"):
        if not os.path.relpath(path, FAMILIES_DIR).startswith(".."):
            continue
        outside |= {m for m in _imported_modules(path) if m != module_name(path)}
    single = sorted(f"{m} (only {sorted(names)[0]})" for m, names in users.items()
                    if len(names) == 1 and m.startswith("maxtrain.models.") and m not in outside
                    and not m.startswith("maxtrain.models.vision.")
                    and os.path.exists(os.path.join(REPO, *m.split(".")) + ".py"))
    assert not single, f"shared modules used by one family alone: {single}; move each into its family's folder"


def test_no_family_is_named_in_the_shared_checks():
    """A family's rules are its registry row's (settings, usual values, mixer, ...): the shared checks read the
    row, and never compare decoder_block with a family's name."""
    from maxtrain.config import registry  # pylint: disable=import-outside-toplevel

    names = set(registry.FAMILIES) | {t for f in registry.FAMILIES.values() for t in f.hf_model_types}
    for module in ("checks", "features", "limits"):
        with open(os.path.join(REPO, "maxtrain", "config", f"{module}.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        named = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names})
        assert not named, f"config/{module}.py names the families {named}: declare the rule in their registry rows"


def test_every_family_setting_is_a_checked_model_key():
    """A checkpoint is checked against the model keys (models.SHAPE_KEYS, SETTING_KEYS): a setting a family
    reads that is not among them would let a checkpoint written with another value load unchecked."""
    from maxtrain.config import registry  # pylint: disable=import-outside-toplevel
    from maxtrain.models import model_keys  # pylint: disable=import-outside-toplevel
    from maxtrain.models.families import FAMILIES  # pylint: disable=import-outside-toplevel

    for name, row in registry.FAMILIES.items():
        missing = sorted(set(row.settings) - set(row.kernel_settings) - set(model_keys.MODEL_KEYS))
        assert not missing, f"{name}'s settings {missing} are no model keys: add them to its shape_keys or setting_keys"
        assert FAMILIES[name].row is row


def test_the_decoder_calls_only_the_contract():
    """models/decoder.py uses a family through its FamilyModel's fields alone: no attribute is probed."""
    from maxtrain.models import contract  # pylint: disable=import-outside-toplevel

    fields = {f.name for f in dataclasses.fields(contract.FamilyModel)}
    with open(os.path.join(REPO, "maxtrain", "models", "decoder.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "family"}
    assert used and used <= fields, f"decoder.py uses family.{sorted(used - fields)}, which the contract lacks"
    probes = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("hasattr", "getattr")]
    assert not probes, "decoder.py probes attributes with hasattr/getattr: add the field to models/contract.py"


def rebinding_sites(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of each place that resolves a model from its config: calls of a family's `layer_types`
    (outside a `layer_types` definition, which may delegate to a shared one), `FAMILIES[...]` looked up by a
    config's decoder_block (Hugging Face conversion looks one up by its model_type, before any config), and
    `Model.bind(...)`."""
    found = []

    def visit(node, inside_layer_types: bool):
        for child in ast.iter_child_nodes(node):
            inside = inside_layer_types or (isinstance(child, ast.FunctionDef) and child.name == "layer_types")
            if isinstance(child, ast.Call):
                name = dotted(child.func)
                if name.split(".")[-1] == "layer_types" and not inside:
                    found.append((child.lineno, f"{name}(...)"))
                if name.endswith("Model.bind"):
                    found.append((child.lineno, "Model.bind(...)"))
            if (isinstance(child, ast.Subscript) and dotted(child.value).split(".")[-1] == "FAMILIES"
                    and any(isinstance(n, ast.Attribute) and n.attr == "decoder_block" for n in ast.walk(child.slice))):
                found.append((child.lineno, f"{dotted(child.value)}[...]"))
            visit(child, inside)

    visit(tree, False)
    return found


def test_the_model_is_bound_once():
    """Model.bind (models/model.py) is the one place in models/ that resolves the family and its layers' kinds
    from the config; every other model function receives the bound Model. Outside models/, a command, a tool
    or the builder binds the model of what it loads (and passes it on); nothing else looks a family up again.
    The rule's own check: a function that re-resolves is found."""
    assert rebinding_sites(ast.parse("def f(model, config):\n    return model.family.layer_types(config)\n"))
    assert rebinding_sites(ast.parse("def f(config):\n    return FAMILIES[config.decoder_block]\n"))
    assert not rebinding_sites(ast.parse("def layer_types(config):\n    return hybrid.layer_types(config)\n"))
    binders = {"maxtrain/models/model.py"}
    found = []
    for path in python_files("maxtrain/models"):
        rel = os.path.relpath(path, REPO)
        if rel not in binders:
            found += [f"{rel}:{line}: {what}" for line, what in rebinding_sites(parse(path))]
    # Outside models/: only Model.bind, once where a model enters (the builder, a checkpoint's or a config's
    # tools); never a family's layer_types or a FAMILIES lookup by the config.
    for path in python_files("maxtrain"):
        rel = os.path.relpath(path, REPO)
        if not rel.startswith("maxtrain/models/"):
            found += [f"{rel}:{line}: {what}" for line, what in rebinding_sites(parse(path))
                      if what != "Model.bind(...)"]
    assert not found, ("these resolve the family or the layer kinds from the config again; take the bound "
                       "model (models/model.py) as an argument instead:\n" + "\n".join(found))


def test_no_test_loads_a_script_by_its_path():
    """scripts/ and end_to_end/ are commands, not libraries: a test imports the package modules that hold their
    logic, and checks a script's own behaviour by running it (`python scripts/x.py ...`, or in the one child
    process tests/command_child.py runs them in), never by loading its file into the test process."""
    loaders = ("spec_from_file_location", "run_path", "SourceFileLoader", "load_source")
    offenders = []
    for path in python_files("tests"):
        if os.path.basename(path) in ("command_child.py", "test_house.py"):  # a process of its own, running each
            continue                                                     # script as `python` does; this rule
        text = open(path, encoding="utf-8").read()
        for number, line in enumerate(text.splitlines(), 1):
            if any(name in line for name in loaders) or ("sys.path" in line and ("scripts" in line
                                                                               or "end_to_end" in line)):
                offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, "tests that load a script by its path (import the package instead, or run the script):\n" \
        + "\n".join(offenders)


def _layout_classes() -> set[str]:
    """The names of models/hf.py's Layout and of every layout class (the families' own included)."""
    from maxtrain.models import families  # pylint: disable=import-outside-toplevel,unused-import  # every family
    from maxtrain.models import hf  # pylint: disable=import-outside-toplevel

    found, todo = set(), [hf.Layout]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found


def _switches_on(tree: ast.AST, layouts: set[str]) -> list[int]:
    """Lines that switch on layout types: isinstance/issubclass against a layout class, a type(...) or
    __class__ comparison that names one, a match case with a layout class pattern."""
    def names(node) -> set[str]:
        return {getattr(n, "id", None) or getattr(n, "attr", None) or (n.value if isinstance(n, ast.Constant)
                                                                       and isinstance(n.value, str) else None)
                for n in ast.walk(node)}

    def is_type(node) -> bool:
        return any((isinstance(n, ast.Call) and getattr(n.func, "id", "") == "type")
                   or (isinstance(n, ast.Attribute) and n.attr == "__class__") for n in ast.walk(node))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("isinstance", "issubclass") \
                and len(node.args) == 2 and names(node.args[1]) & layouts:
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_type(o) for o in [node.left, *node.comparators]) \
                and names(node) & layouts:
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchClass) and names(node.cls) & layouts:
            lines.append(node.lineno)
    return lines


def test_conversion_does_not_switch_on_layout_types():
    """Each Hugging Face layout (models/hf.py's Layout) converts its own tensors: checkpointing/ calls a
    layout's methods and never asks which layout it holds."""
    layouts = _layout_classes()
    assert {"Layout", "Linear", "Interleaved", "GroupRows"} <= layouts
    switching = ("isinstance(n_in, Interleaved)", "isinstance(n_in, (hf.Grouped, int))", "type(n_in) is PairedRope",
                 "type(n_in).__name__ == 'Halves'", "match n_in:\n    case GroupRows(groups=g): pass")
    for source in switching:  # the rule can fail
        assert _switches_on(ast.parse(source), layouts), source
    assert not _switches_on(ast.parse("isinstance(value, dict)\nlayout.export(w, out, name, dtype)"), layouts)
    offenders = [f"{os.path.relpath(path, REPO)}:{line}" for path in python_files("maxtrain/checkpointing")
                 for line in _switches_on(parse(path), layouts)]
    assert not offenders, f"conversion switches on layout types at {offenders}: give the layout a method instead"


def misnamed_imports(tree: ast.Module, is_module) -> list[tuple[int, str]]:
    """(line, "module as alias") of each maxtrain module imported under a name that does not hold its own
    (`stages as pipeline_lib` beside data.pipeline; `fit as memory_lib`): an alias may only qualify the name
    (`files as checkpoint_files`, `config as config_lib`). `is_module(dotted)` says whether a name is a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maxtrain"):
            for a in node.names:
                if a.asname and is_module(f"{node.module}.{a.name}") and a.name not in a.asname:
                    found.append((node.lineno, f"{a.name} as {a.asname}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith("maxtrain") and a.name.split(".")[-1] not in a.asname:
                    found.append((node.lineno, f"{a.name} as {a.asname}"))
    return found


def test_modules_are_imported_by_their_own_names():
    def is_module(dotted: str) -> bool:
        path = os.path.join(REPO, *dotted.split("."))
        return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))

    assert misnamed_imports(ast.parse("from maxtrain.parallel import stages as pipeline_lib\n"), is_module)
    assert not misnamed_imports(ast.parse("from maxtrain.checkpointing import files as checkpoint_files\n"), is_module)
    found = [f"{os.path.relpath(path, REPO)}:{line}: {what}"
             for path in python_files("maxtrain", "scripts", "tests", "end_to_end")
             for line, what in misnamed_imports(parse(path), is_module)]
    assert not found, "import these modules under their own names (an alias may qualify one):\n" + "\n".join(found)


def test_no_module_hides_a_module_it_imports():
    """A function or class named like a module the same file imports replaces the module for the whole file
    (convert.py's model_keys() hid models/model_keys.py; gpu_check's kernel_check() hid the attention's)."""
    found = []
    for path in python_files("maxtrain", "scripts"):
        tree = parse(path)
        imported = {a.asname or a.name.split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        found += [f"{os.path.relpath(path, REPO)}: {name}" for name in sorted(imported & defined)]
    assert not found, "these definitions hide an import of the same name: " + ", ".join(found)


def test_commands_are_thin():
    """A command parses, builds, runs and prints: what it computes lives in the package (compile/, training/,
    gpu_check/), so each command module stays under 150 lines."""
    long = {c: n for c in COMMANDS
            if (n := sum(1 for _ in open(os.path.join(PACKAGE, f"{c}.py"), encoding="utf-8"))) > 150}
    assert not long, f"commands over 150 lines: {long}; move what they compute into the package"

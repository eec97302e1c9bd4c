"""The docs read as a manual: each page says what it lets you do, then shows a command that runs as written.

For README.md and every docs/**/*.md page (no training, no JAX):
- the page opens with its title, then prose, then, within its first OPENING_LINES lines, a fenced command;
- the commands of that first block are real: `python -m maxtrain.<name>` names a command, a script or
  end_to_end path exists, and where a command takes a config (`CONFIG.yml key=value ...`) the config loads
  with exactly those keys and values (maxtrain.config.load_config). A block that shows a command failing
  (`$ command` followed by `maxtrain: error: ...`) must fail with that message;
- every path it names under maxtrain/, scripts/, configs/, tests/ or end_to_end/ (and every module named
  from inside the package, e.g. `models/attention/`) exists, and so does every page it links to, with
  the heading a link's #anchor names;
- performance.md, the README and architecture.md keep to their lengths;
- the README's table of families and presets lists every family of maxtrain/config/registry.py and, in each
  family's row, exactly its presets of configs/models/ (and its counts of them in prose are those numbers).

test_broken_pages_are_caught and test_broken_model_tables_are_caught feed the checkers pages broken in each of
these ways.
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest
import yaml

from maxtrain.config import load_config, registry
from maxtrain.config.schema import defaults, table
from maxtrain.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                           recursive=True))
MAX_LINES = {"docs/performance.md": 300, "README.md": 250, "docs/architecture.md": 175}
OPENING_LINES = 25
PACKAGES = tuple(name for name in sorted(os.listdir(os.path.join(ROOT, "maxtrain")))
                 if os.path.isfile(os.path.join(ROOT, "maxtrain", name, "__init__.py")))
COMMANDS = tuple(name[:-3] for name in sorted(os.listdir(os.path.join(ROOT, "maxtrain")))
                 if name.endswith(".py") and "\ndef main(" in open(os.path.join(ROOT, "maxtrain", name)).read())
COMMAND_WORDS = {"python", "python3", "pip", "pytest", "lint-imports", "bash", "for", "git"}
SHELL_OPERATORS = {"&", "&&", ";", "|", "||", ">", ">>", "2>&1"}

REPO_PATH = re.compile(r"(?<![\w./$<-])((?:maxtrain|scripts|configs|tests|end_to_end)/[\w./-]*)")
PACKAGE_MODULE = re.compile(r"(?<![\w./$<-])((?:%s)/[\w/]*\.py)\b" % "|".join(PACKAGES))
LINK = re.compile(r"\]\(([^)\s]+?\.md)(?:#([^)\s]*))?\)")
INVOCATION = re.compile(r"\bpython3? (?:-m (maxtrain(?:\.\w+)+)|((?:scripts|end_to_end)/[\w./-]+\.py))(.*)")


def fenced_blocks(lines: list[str]):
    """(index of the opening fence, the lines inside) for every fenced block."""
    start = None
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            if start is None:
                start = i
            else:
                yield start, lines[start + 1:i]
                start = None


def shell_lines(block: list[str]) -> list[str]:
    """The block's lines with backslash continuations joined and a leading `$ ` prompt removed."""
    joined, current = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    if current:
        joined.append(current)
    return [line.strip()[2:] if line.strip().startswith("$ ") else line.strip() for line in joined]


def is_command(line: str) -> bool:
    """Whether a line of a block is a shell command one could type (not output, a tree or YAML)."""
    words = [w for w in line.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    return bool(words) and (words[0] in COMMAND_WORDS or os.path.isfile(os.path.join(ROOT, words[0])))


def config_argv(words: list[str]) -> list[str] | None:
    """A command's config and key=value arguments (options and their values dropped), or None without a config.
    key=$VAR words are kept out (the shell fills them in) once their key is checked."""
    argv, skip_value = [], False
    for word in words:
        if word in SHELL_OPERATORS or word.endswith((";", "&")):
            break
        if word.startswith("--"):
            skip_value = "=" not in word
            continue
        if skip_value and "=" not in word and not word.endswith((".yml", ".yaml")):
            skip_value = False
            continue
        skip_value = False
        if word.startswith("#"):
            break
        argv.append(word)
    configs = [i for i, word in enumerate(argv) if word.endswith((".yml", ".yaml")) and "=" not in word]
    if not configs:
        return None
    argv = argv[configs[0]:]
    return [argv[0]] + [w for w in argv[1:] if "=" in w]


def command_problems(line: str, shown_error: str | None) -> list[str]:
    """What is wrong with one command line of a page's opening block."""
    match = INVOCATION.search(line)
    if not match:
        return []
    module, script, rest = match.groups()
    if module:
        name = module.split(".", 1)[1]
        if name not in COMMANDS:
            return [f"`python -m {module}` is not a command (commands: {', '.join(COMMANDS)})"]
    elif not os.path.exists(os.path.join(ROOT, script)):
        return [f"{script} does not exist"]
    try:
        words = shlex.split(rest, comments=False)
    except ValueError as error:
        return [f"cannot split {line!r} as a shell command: {error}"]
    argv = config_argv(words)
    if argv is None:
        return [] if shown_error is None else [f"{line!r} shows an error but takes no config"]
    schema = table()
    shell_filled = [w for w in argv[1:] if "$" in w.partition("=")[2]]
    problems = [f"{w.partition('=')[0]!r} is not a config key" for w in shell_filled
                if w.partition("=")[0] not in schema]
    argv = [argv[0]] + [w for w in argv[1:] if w not in shell_filled]
    if not os.path.isabs(argv[0]):
        argv[0] = os.path.join(ROOT, argv[0]) if os.path.exists(os.path.join(ROOT, argv[0])) else argv[0]
    try:
        load_config(argv, log=lambda note: None)
    except UserError as error:
        if shown_error is None:
            problems.append(f"{line!r}: its config does not load: {error}")
        elif str(error).strip() != shown_error:
            problems.append(f"{line!r} fails with {str(error).strip()!r}, the page shows {shown_error!r}")
        return problems
    if shown_error is not None:
        problems.append(f"{line!r} loads its config, but the page shows it failing: {shown_error!r}")
    return problems


def opening_problems(lines: list[str]) -> list[str]:
    """Title, then prose, then a fenced command within the first OPENING_LINES lines, whose commands are real."""
    if not lines or not lines[0].startswith("# "):
        return ["does not open with a `# Title` line"]
    body = [(i, line) for i, line in enumerate(lines[1:], 1) if line.strip()]
    if not body or body[0][1].lstrip().startswith(("```", "|", "#", "- ", "* ", "<", "    ")):
        return ["the title is not followed by prose saying what the page lets you do"]
    first = next(fenced_blocks(lines), None)
    if first is None or first[0] >= OPENING_LINES:
        where = "none" if first is None else f"the first starts at line {first[0] + 1}"
        return [f"no fenced command within the first {OPENING_LINES} lines ({where})"]
    commands = shell_lines(first[1])
    if not any(is_command(line) for line in commands):
        return ["the first fenced block holds no command"]
    problems = []
    for k, line in enumerate(commands):
        if not line or line.startswith("#") or line.startswith("maxtrain: error:"):
            continue
        following = commands[k + 1] if k + 1 < len(commands) else ""
        shown = following[len("maxtrain: error: "):].strip() if following.startswith("maxtrain: error: ") else None
        problems += command_problems(line, shown)
    return problems


def path_problems(text: str) -> list[str]:
    """Paths the page names that do not exist."""
    missing = []
    for match in REPO_PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(path)
    for match in PACKAGE_MODULE.finditer(text):
        if not os.path.exists(os.path.join(ROOT, "maxtrain", match.group(1))):
            missing.append(match.group(1))
    return [f"names {path}, which does not exist" for path in sorted(set(missing))]


def anchors(text: str) -> set[str]:
    """The #anchors of a page's headings, as GitHub makes them."""
    found, seen = set(), {}
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def link_problems(name: str, text: str) -> list[str]:
    """Links to pages that do not exist, or to headings they do not have."""
    problems = []
    for target, anchor in LINK.findall(text):
        if re.match(r"\w+://", target):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(name), target))
        full = os.path.join(ROOT, path)
        if not os.path.exists(full):
            problems.append(f"links to {target}, which does not exist")
        elif anchor:
            with open(full, encoding="utf-8") as f:
                if anchor not in anchors(f.read()):
                    problems.append(f"links to {target}#{anchor}, a heading {target} does not have")
    return problems


def page_problems(name: str, text: str) -> list[str]:
    lines = text.splitlines()
    problems = opening_problems(lines) + path_problems(text) + link_problems(name, text)
    if name in MAX_LINES and len(lines) > MAX_LINES[name]:
        problems.append(f"{len(lines)} lines, more than {MAX_LINES[name]}")
    return problems


MODELS_HEADING = "## Families and presets"


def preset_families() -> dict[str, str]:
    """Each preset of configs/models/ and the family (decoder_block) it sets."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.yml"))):
        with open(path, encoding="utf-8") as f:
            found[os.path.basename(path)[:-4]] = (yaml.safe_load(f) or {}).get("decoder_block",
                                                                                 defaults()["decoder_block"])
    return found


def model_table_problems(text: str, families: tuple[str, ...], presets: dict[str, str]) -> list[str]:
    """How the README's table under MODELS_HEADING (rows `| `family` | models | `preset`, ... |`) and its
    counts ("17 model families", "34 presets") differ from the registry's families and the presets."""
    lines = text.splitlines()
    if MODELS_HEADING not in lines:
        return [f"has no {MODELS_HEADING!r} section"]
    start = lines.index(MODELS_HEADING) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    rows = {}
    for line in lines[start:end]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            family = cells[0].strip("`")
            if family in rows:
                return [f"lists family {family} twice"]
            rows[family] = re.findall(r"`([^`]+)`", cells[-1])
    problems = [f"lists no family {name} (maxtrain/config/registry.py has it)" for name in families if name not in rows]
    problems += [f"lists family {name}, which maxtrain/config/registry.py does not have" for name in rows
                 if name not in families]
    listed = {p: f for f, names in rows.items() for p in names}
    for preset, family in presets.items():
        if preset not in listed:
            problems.append(f"lists no preset {preset} (configs/models/{preset}.yml, family {family})")
        elif listed[preset] != family:
            problems.append(f"lists preset {preset} under {listed[preset]}, but its decoder_block is {family}")
    problems += [f"lists preset {p}, which configs/models/ does not have" for p in listed if p not in presets]
    problems += [f"lists preset {p} twice" for p in sorted(set(listed)) if sum(n.count(p) for n in rows.values()) > 1]
    for count, what, actual in [(int(n), "model families", len(families))
                                for n in re.findall(r"(\d+) model families", text)] + \
                               [(int(n), "presets", len(presets)) for n in re.findall(r"(\d+) presets", text)]:
        if count != actual:
            problems.append(f"says {count} {what}, but there are {actual}")
    return problems


def test_readme_lists_every_family_and_preset():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert model_table_problems(f.read(), tuple(registry.FAMILIES), preset_families()) == []


TABLE = """# maxtrain

We have 2 model families and 3 presets.

## Families and presets

| family | models | presets |
| --- | --- | --- |
| `llama` | Llama | `default`, `llama3-8b` |
| `qwen3` | Qwen 3 | `qwen3-8b` |

## Next
"""
TABLE_FAMILIES = ("llama", "qwen3")
TABLE_PRESETS = {"default": "llama", "llama3-8b": "llama", "qwen3-8b": "qwen3"}


@pytest.mark.parametrize("families, presets, text, expected", [
    (TABLE_FAMILIES + ("gemma2",), TABLE_PRESETS, TABLE, "lists no family gemma2"),
    (("llama",), {"default": "llama", "llama3-8b": "llama"}, TABLE.replace("2 model", "1 model"),
     "lists family qwen3, which"),
    (TABLE_FAMILIES, {**TABLE_PRESETS, "qwen3-0.6b": "qwen3"}, TABLE, "lists no preset qwen3-0.6b"),
    (TABLE_FAMILIES, {**TABLE_PRESETS, "llama3-8b": "qwen3"}, TABLE, "lists preset llama3-8b under llama"),
    (TABLE_FAMILIES, {"default": "llama", "qwen3-8b": "qwen3"}, TABLE, "lists preset llama3-8b, which"),
    (TABLE_FAMILIES, TABLE_PRESETS, TABLE.replace("`qwen3-8b` |", "`qwen3-8b`, `default` |"),
     "lists preset default twice"),
    (TABLE_FAMILIES, TABLE_PRESETS, TABLE.replace("3 presets", "4 presets"), "says 4 presets, but there are 3"),
    (TABLE_FAMILIES, TABLE_PRESETS, TABLE.replace("## Families and presets", "## Models"), "has no"),
])
def test_broken_model_tables_are_caught(families, presets, text, expected):
    assert model_table_problems(TABLE, TABLE_FAMILIES, TABLE_PRESETS) == []
    problems = model_table_problems(text, families, presets)
    assert any(expected in problem for problem in problems), problems


def test_the_pages_are_found():
    assert {"README.md", "docs/performance.md", "docs/architecture.md"} <= set(PAGES)
    assert {"train", "decode", "inspect_checkpoint"} <= set(COMMANDS) and "errors" not in COMMANDS


@pytest.mark.parametrize("name", PAGES)
def test_page_reads_as_a_manual(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        assert page_problems(name, f.read()) == []


GOOD = """# A page

This page lets you do a thing.

```bash
python -m maxtrain.train configs/base.yml steps=3 dataset_type=synthetic
```

See `maxtrain/models/attention/` and `training/loop.py`.
"""


@pytest.mark.parametrize("broken, expected", [
    (GOOD.replace("This page lets you do a thing.\n", ""), "not followed by prose"),
    (GOOD.replace("This page", "\n" * OPENING_LINES + "This page"), "no fenced command within the first"),
    (GOOD.replace("python -m maxtrain.train configs/base.yml", "outputs/run/\n  checkpoints/"),
     "the first fenced block holds no command"),
    (GOOD.replace("steps=3", "stepz=3"), "unknown config key 'stepz'"),
    (GOOD.replace("steps=3", "steps=-3"), "steps=-3 is not allowed"),
    (GOOD.replace("configs/base.yml steps", "configs/nowhere.yml steps"), "names configs/nowhere.yml"),
    (GOOD.replace("maxtrain.train", "maxtrain.trian"), "is not a command"),
    (GOOD.replace("python -m maxtrain.train", "python scripts/benchmark_nothing.py"), "does not exist"),
    (GOOD.replace("models/attention/", "attention.py"), "names maxtrain/attention.py"),
    (GOOD.replace("training/loop.py", "training/looop.py"), "names training/looop.py"),
    (GOOD.replace("steps=3 dataset_type=synthetic\n", "steps=3\nmaxtrain: error: something else\n"),
     "loads its config, but the page shows it failing"),
    (GOOD + "See [x](nowhere.md).\n", "links to nowhere.md, which does not exist"),
    (GOOD + "See [x](performance.md#no-such-heading).\n", "a heading performance.md does not have"),
])
def test_broken_pages_are_caught(broken, expected):
    problems = page_problems("docs/example.md", broken)
    assert any(expected in problem for problem in problems), problems


def test_good_example_and_a_shown_error_pass():
    assert page_problems("docs/example.md", GOOD + "See [x](performance.md#how-to-measure).\n") == []
    shown = GOOD.replace("python -m maxtrain.train configs/base.yml steps=3 dataset_type=synthetic",
                         "$ python -m maxtrain.train configs/base.yml base_emb_dimm=64\n"
                         "maxtrain: error: unknown config key 'base_emb_dimm': did you mean base_emb_dim?")
    assert page_problems("docs/example.md", shown) == []


def test_length_limits_are_enforced():
    assert any("more than 300" in p for p in page_problems("docs/performance.md", GOOD + "x\n" * 300))
    assert any("more than 250" in p for p in page_problems("README.md", GOOD + "x\n" * 250))

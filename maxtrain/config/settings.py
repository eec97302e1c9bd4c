"""The settings table: every config key's default, type, allowed values and meaning, read from base.yml.

configs/base.yml declares each key on one line, and that line is the whole declaration:

    steps: 300                            # {>= 1} total optimizer steps
    eval_steps: 8                         # {-1 | >= 1} batches per evaluation; -1 = one epoch
    warmup_steps_fraction: 0.05           # {[0, 1]} fraction of the schedule spent in warmup
    dtype: "autoselected"                 # {autoselected | float32 | bfloat16 | float16} compute dtype
    run_name: ""                          # run directory name (no braces: any string)

- the default gives the type (an int is accepted where a float is expected);
- `{...}` at the start of the comment gives the allowed values: alternatives separated by `|`, each
  `>= x`, `> x`, `<= x`, `< x`, an interval `[a, b]`, `(a, b]`, `[a, b)`, `(a, b)` (a or b may be
  `inf` / `-inf`), or one exact value (a number, or a word for string keys). `{$name}` alone stands
  for a list of words the code declares once (read_table's `named`: `$families` is the model
  families of config/registry.py). Every int and float
  key must declare one (a float range never admits nan; write `inf` only on an open side);
- the rest of the comment is the description, quoted in error messages.

Adding a key with its range is therefore a one-line change to base.yml. Rules that relate several
keys (heads divisible by kv heads, ...) are the named checks in checks.py.

YAML is read with `read_mapping`, which refuses an empty file and a key written twice, naming the
file and both lines; loading.py uses the same rule for a key given twice on the command line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import yaml

from maxtrain.errors import ConfigError

_RELATION = re.compile(r"^(>=|>|<=|<)\s*(\S+)$")
_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])$")


# --------------------------------------------------------------------------------------------
# YAML mappings: every key once, and at least one
# --------------------------------------------------------------------------------------------


def unique(assignments: list[tuple[str, Any, str]], source: str) -> dict[str, Any]:
    """{key: value} from (key, value, where) triples; a key given twice is a ConfigError naming both.

    The one rule for duplicates: a YAML mapping (where = "line N") and the command line
    (where = "argument N") both go through here.
    """
    out, seen = {}, {}
    for key, value, where in assignments:
        if key in seen:
            name = key if str(key).isprintable() else repr(key)  # the error stays one line
            raise ConfigError(f"{source} sets {name} twice ({seen[key]} and {where}); keep one of them")
        seen[key] = where
        out[key] = value
    return out


def _check_nested(node: yaml.Node, path: str) -> None:
    if isinstance(node, yaml.MappingNode):
        pairs = [(k.value if isinstance(k, yaml.ScalarNode) else str(k.value), None, f"line {k.start_mark.line + 1}")
                 for k, _ in node.value]
        unique(pairs, path)
        for _, value in node.value:
            _check_nested(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for value in node.value:
            _check_nested(value, path)


def read_mapping(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """({key: value}, {key: line}) of a YAML file that must be a non-empty mapping with unique keys."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist. Pass a YAML file such as configs/base.yml.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {path!r} is not valid YAML{at}: {getattr(e, 'problem', None) or e}".replace(
            "\n", " ")) from None
    if node is None:
        raise ConfigError(f"config file {path!r} is empty. Write the settings you change in it, one `key: value` "
                          "per line (it inherits configs/base.yml), or pass configs/base.yml itself.")
    if not isinstance(node, yaml.MappingNode):
        kind = {yaml.SequenceNode: "a list", yaml.ScalarNode: "a single value"}.get(type(node), "not a mapping")
        raise ConfigError(f"config file {path!r} must be a mapping of `key: value` lines, but it is {kind}")
    _check_nested(node, f"config file {path!r}")
    values = yaml.safe_load(text) or {}
    lines = {}
    for key_node, _ in node.value:
        lines[str(key_node.value)] = key_node.start_mark.line + 1
    values = {str(k): v for k, v in values.items()}
    return values, lines


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values a key may take: the union of exact values, intervals and half-lines."""

    text: str                                     # as written in base.yml, e.g. "-1 | >= 1"
    exact: tuple[Any, ...] = ()
    ranges: tuple[tuple[float, bool, float, bool], ...] = ()   # (low, low inclusive, high, high inclusive)

    def admits(self, value) -> bool:
        if isinstance(value, bool):
            return False
        if value in self.exact:
            return True
        if isinstance(value, (int, float)) and not math.isnan(value):
            for low, low_in, high, high_in in self.ranges:
                if (value > low or (low_in and value == low)) and (value < high or (high_in and value == high)):
                    return True
        return False

    def describe(self) -> str:
        """"one of: a, b, c" for choices, else the alternatives as written ("-1 or >= 1")."""
        if not self.ranges and all(isinstance(v, str) for v in self.exact):
            return "one of: " + ", ".join(self.exact)
        parts = [part.strip() for part in self.text.split("|")]
        return " or ".join("in " + p if _INTERVAL.match(p) else p for p in parts)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    allowed: Allowed | None
    description: str
    line: int

    @property
    def kind(self) -> type:
        return type(self.default)


def _number(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} in the allowed values is not a number") from None


def parse_allowed(text: str, default: Any, where: str) -> Allowed:
    """`>= 1`, `-1 | >= 1`, `[0, 1)`, `a | b | c` -> Allowed (see the module docstring)."""
    numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
    exact, ranges = [], []
    for part in (p.strip() for p in text.split("|")):
        relation, interval = _RELATION.match(part), _INTERVAL.match(part)
        if not part:
            raise ConfigError(f"{where}: empty alternative in {{{text}}}")
        if numeric and relation:
            op, bound = relation.group(1), _number(relation.group(2), where)
            ranges.append({">=": (bound, True, math.inf, False), ">": (bound, False, math.inf, False),
                           "<=": (-math.inf, False, bound, True), "<": (-math.inf, False, bound, False)}[op])
        elif numeric and interval:
            low, high = _number(interval.group(2), where), _number(interval.group(3), where)
            ranges.append((low, interval.group(1) == "[", high, interval.group(4) == "]"))
        elif numeric:
            value = _number(part, where)
            exact.append(int(value) if isinstance(default, int) and value.is_integer() else value)
        else:
            exact.append(part)
    allowed = Allowed(text.strip(), tuple(exact), tuple(ranges))
    if not allowed.admits(default):
        raise ConfigError(f"{where}: the default {default!r} is not in its own allowed values {{{text}}}")
    return allowed


def _comment(line: str) -> str:
    """The comment of a YAML line (after the first # that is outside quotes and follows a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[i + 1:].strip()
    return ""


def read_table(path: str, named: dict[str, tuple[str, ...]] | None = None) -> dict[str, Setting]:
    """The settings declared in base.yml: {name: Setting}, in file order. `named`: the lists `{$name}` stands for."""
    values, lines = read_mapping(path)
    with open(path, encoding="utf-8") as f:
        text_lines = f.read().splitlines()
    table = {}
    for name, default in values.items():
        line = lines[name]
        comment = _comment(text_lines[line - 1])
        allowed = None
        if comment.startswith("{"):
            end = comment.find("}")
            if end < 0:
                raise ConfigError(f"{path} line {line}: {name}'s allowed values start with {{ but have no closing }}")
            text = comment[1:end].strip()
            if text.startswith("$"):
                if text[1:] not in (named or {}):
                    raise ConfigError(f"{path} line {line}: {name}'s allowed values {{{text}}} name no list "
                                      f"(known: {', '.join('$' + k for k in named or {}) or 'none'})")
                text = " | ".join(named[text[1:]])
            allowed = parse_allowed(text, default, f"{path} line {line} ({name})")
            comment = comment[end + 1:].strip()
        table[name] = Setting(name, default, allowed, comment, line)
    return table


def check_value(setting: Setting, value: Any) -> None:
    """ConfigError naming the key, the value and the allowed values when `value` is not allowed."""
    if setting.allowed is None or setting.allowed.admits(value):
        return
    what = f"{setting.name}={value!r}" if isinstance(value, str) else f"{setting.name}={value}"
    meaning = f" ({setting.name}: {setting.description})" if setting.description else ""
    raise ConfigError(f"{what} is not allowed: it must be {setting.allowed.describe()}{meaning}")

"""The settings table (configs/base.yml read by maxtrain/config/settings.py) and the override parser.

- Every number and choice key is walked with values outside its declared range (and nan, inf, -inf
  for every float key); every entry point that takes config keys answers each with exit status 2
  and one line naming the key, the value and the allowed values. The values come from the table,
  so a key added to base.yml is covered without touching this file.
- YAML files: an empty file, a key written twice, a file without base_config (partial: inherits
  base.yml with one note), a chain with base_config.
- The override parser under Hypothesis: any argv gives a Config or one ConfigError line.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import BASE_YML, REPO
from maxtrain import config as config_lib
from maxtrain.config import settings as settings_lib
from maxtrain.errors import ConfigError, run_cli

TABLE = config_lib.table()


def _entry_points():
    """(program name, main) of every entry point that reads config keys."""
    from maxtrain import decode, inspect_data, train, viz  # pylint: disable=import-outside-toplevel
    from maxtrain.training import benchmark  # pylint: disable=import-outside-toplevel

    return [("maxtrain", train.main), ("maxtrain.decode", decode.main), ("maxtrain.viz", viz.main),
            ("maxtrain.inspect_data", inspect_data.main), ("benchmark", benchmark.run)]


ENTRY_POINTS = _entry_points()


def outside(setting: settings_lib.Setting) -> list:
    """Values just outside a setting's allowed values (and nan / inf / -inf for floats)."""
    allowed, default = setting.allowed, setting.default
    if isinstance(default, str):
        return ["not_" + "_".join(allowed.exact)[:20]]
    step = 1 if isinstance(default, int) else 0.5
    candidates = []
    for low, _, high, _ in allowed.ranges:
        for bound in (low, high):
            if math.isfinite(bound):
                candidates += [bound - step, bound, bound + step]
    for value in allowed.exact:
        candidates += [value - step, value + step]
    if isinstance(default, float):
        candidates += [math.nan, math.inf, -math.inf]
    else:
        candidates = [int(c) for c in candidates if float(c).is_integer()]
    found = []
    for c in candidates:
        if not allowed.admits(c) and c not in found and not (isinstance(c, float) and math.isnan(c) and
                                                                any(isinstance(f, float) and math.isnan(f) for f in found)):
            found.append(c)
    return found


def _text(value) -> str:
    return value if isinstance(value, str) else repr(value) if isinstance(value, int) else str(value)


CASES = [(name, value) for name, s in TABLE.items() if s.allowed is not None for value in outside(s)]


def test_every_number_key_declares_its_allowed_values():
    numbers = [name for name, s in TABLE.items() if type(s.default) in (int, float)]
    undeclared = [name for name in numbers if TABLE[name].allowed is None]
    assert not undeclared, f"base.yml: these number keys declare no {{allowed values}}: {undeclared}"
    assert len(numbers) >= 50
    for name in numbers:
        assert outside(TABLE[name]), f"{name}: no value outside {TABLE[name].allowed.text}?"
    for name, s in TABLE.items():
        assert s.description, f"base.yml key {name} has no description"


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={_text(v)}" for k, v in CASES])
def test_values_outside_the_range_stop_every_entry_point_with_one_line(key, value, capsys):
    shown = f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
    for prog, main in ENTRY_POINTS:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(prog, main, [BASE_YML, f"{key}={_text(value)}"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (prog, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: {shown} is not allowed: it must be "), (
            prog, err)
        assert TABLE[key].allowed.describe() in lines[0]


def test_benchmark_input_answers_a_value_outside_the_range_as_the_commands_do():
    """scripts/benchmark_input.py (a script: run as one) reads its keys through the same table and error path."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "benchmark_input.py"), BASE_YML,
                           "eval_steps=0"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("benchmark_input: error: eval_steps=0 is not allowed: it must be "), lines[0]


def test_range_messages_read_as_the_table_says():
    with pytest.raises(ConfigError) as e:
        config_lib.load_config([BASE_YML, "eval_steps=0"])
    assert str(e.value) == ("eval_steps=0 is not allowed: it must be -1 or >= 1 (eval_steps: batches per evaluation, "
                            "the same first ones every time; -1 = exactly one epoch of the eval set)")
    with pytest.raises(ConfigError, match=r"adam_b2=1.0 is not allowed: it must be in \[0, 1\)"):
        config_lib.load_config([BASE_YML, "adam_b2=1"])
    # The sweep of issue 19: each of these used to train silently.
    for bad in ("learning_rate_schedule_steps=-5", "adam_eps=-1", "adam_weight_decay=-5", "grain_worker_count=-2",
                "peak_tflops_per_device=-3"):
        with pytest.raises(ConfigError, match=f"^{bad.split('=')[0]}=.* is not allowed"):
            config_lib.load_config([BASE_YML, bad])


def test_the_table_refuses_a_malformed_declaration(tmp_path):
    bad = tmp_path / "base.yml"
    bad.write_text("steps: 0    # {>= 1} total steps\n")
    with pytest.raises(ConfigError, match="line 1 .steps.: the default 0 is not in its own allowed values"):
        settings_lib.read_table(str(bad))
    bad.write_text("steps: 3    # {>= one} total steps\n")
    with pytest.raises(ConfigError, match="'one' in the allowed values is not a number"):
        settings_lib.read_table(str(bad))
    good = tmp_path / "good.yml"
    good.write_text('name: "a#b"    # {a#b | c} a key whose value holds a hash\nrate: 0.5  # {(0, 1)} r\n')
    table = settings_lib.read_table(str(good))
    assert table["name"].allowed.exact == ("a#b", "c") and table["rate"].allowed.admits(0.5)
    assert not table["rate"].allowed.admits(1.0) and not table["rate"].allowed.admits(math.nan)


# --------------------------------------------------------------------------------------------
# YAML files: empty, duplicates, base_config
# --------------------------------------------------------------------------------------------


def test_an_empty_yaml_file_is_refused(tmp_path):
    for text in ("", "\n# only a comment\n"):
        empty = tmp_path / "empty.yml"
        empty.write_text(text)
        with pytest.raises(ConfigError, match=f"config file '{empty}' is empty"):
            config_lib.load_config([str(empty)])


def test_a_key_written_twice_in_a_yaml_mapping_names_the_file_and_both_lines(tmp_path):
    twice = tmp_path / "twice.yml"
    twice.write_text("base_config: base.yml\nsteps: 3\nlog_period: 1\nsteps: 5\n")
    with pytest.raises(ConfigError) as e:
        config_lib.load_config([str(twice)])
    assert str(e.value) == f"config file '{twice}' sets steps twice (line 2 and line 4); keep one of them"
    nested = tmp_path / "nested.yml"
    nested.write_text("logical_axis_rules:\n  - {a: 1, a: 2}\n")
    with pytest.raises(ConfigError, match="sets a twice \\(line 2 and line 2\\)"):
        config_lib.load_config([str(nested)])


def test_a_key_given_twice_on_the_command_line_is_refused():
    with pytest.raises(ConfigError) as e:
        config_lib.load_config([BASE_YML, "steps=3", "seed=1", "steps=5"])
    assert str(e.value) == ("the command line sets steps twice (argument 2: 'steps=3' and argument 4: 'steps=5'); "
                            "keep one of them")


def test_a_yaml_file_without_base_config_inherits_base_yml_and_says_so_once(tmp_path):
    partial = tmp_path / "partial.yml"
    partial.write_text("steps: 3\nlearning_rate: 0.01\n")
    notes = []
    cfg = config_lib.load_config([str(partial), "log_period=1"], log=notes.append)
    assert (cfg.steps, cfg.learning_rate, cfg.log_period, cfg.dataset_type) == (3, 0.01, 1, "default")
    assert notes == [f"note: {partial} has no base_config, so it is applied over {config_lib.BASE_CONFIG} "
                     "(add `base_config: base.yml` to say so)"]
    # With base_config (a name in maxtrain's configs/, or a path): no note.
    for base in ("base.yml", BASE_YML):
        own = tmp_path / "own.yml"
        own.write_text(f"base_config: {base}\nsteps: 4\n")
        notes = []
        assert config_lib.load_config([str(own)], log=notes.append).steps == 4 and notes == []
    # A chain: the nearer file wins.
    child = tmp_path / "child.yml"
    child.write_text("base_config: own.yml\nsteps: 5\nseed: 2\n")
    cfg = config_lib.load_config([str(child)])
    assert (cfg.steps, cfg.seed) == (5, 2)
    missing = tmp_path / "missing_base.yml"
    missing.write_text("base_config: nowhere.yml\nsteps: 5\n")
    with pytest.raises(ConfigError, match="base_config 'nowhere.yml' does not exist"):
        config_lib.load_config([str(missing)])


def test_a_yaml_file_that_is_not_a_mapping_or_not_yaml(tmp_path):
    listing = tmp_path / "list.yml"
    listing.write_text("- steps: 3\n")
    with pytest.raises(ConfigError, match="must be a mapping of `key: value` lines, but it is a list"):
        config_lib.load_config([str(listing)])
    broken = tmp_path / "broken.yml"
    broken.write_text("steps: [3\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line 2") as e:
        config_lib.load_config([str(broken)])
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# The override parser, under Hypothesis
# --------------------------------------------------------------------------------------------

KEYS = sorted(TABLE)
VALUE_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-0", "0x1F", "true", "null", "~", "[", "]", "{a: 1}", "[[1, 2]]",
                     "!!python/object:os.system", "&a", "*a", "'", '"', "1_000", "1e-2", "3.0", "-1", "99999999999999999999",
                     "[[\"batch\", {a: 1}]]", "[]", "[text, text]", "\x00", "\udc80", "é", "a:1", "host:0"]),
    st.integers(-10**20, 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
ARGUMENT = st.one_of(
    st.tuples(st.sampled_from(KEYS), VALUE_TEXT).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=20),
    st.tuples(st.text(max_size=8), VALUE_TEXT).map(lambda kv: f"{kv[0]}={kv[1]}"),
)


def _one_line_or_config(argv):
    try:
        cfg = config_lib.load_config(argv, log=lambda _: None)
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message and "\r" not in message, repr(message)
        assert "Traceback" not in message
        return None
    assert isinstance(cfg, config_lib.Config)
    return cfg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ARGUMENT, max_size=6))
def test_any_overrides_give_a_config_or_one_line(overrides):
    _one_line_or_config([BASE_YML, *overrides])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=30), min_size=0, max_size=3))
def test_any_argv_gives_a_config_or_one_line(argv):
    _one_line_or_config(argv)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_any_yaml_file_gives_a_config_or_one_line(tmp_path, text):
    path = tmp_path / "any.yml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _one_line_or_config([str(path)])


def test_a_key_with_a_line_break_given_twice_is_named_on_one_line():
    """Found by the property test above: a key holding a carriage return split the message in two."""
    with pytest.raises(ConfigError) as error:
        config_lib.load_config([BASE_YML, "0\r0=", "0\r0="])
    assert "sets '0\\r0' twice" in str(error.value) and "\r" not in str(error.value)

"""tests/suite_budget.py: the rule that keeps the README's `pytest` under its budget (the logic, on made-up times)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import suite_budget  # noqa: E402


def test_a_run_within_budget_passes():
    assert suite_budget.check({"tests/a.py::t1": 3.0, "tests/b.py::t2": 14.9}, wall_s=420,
                              wall_budget=600, test_budget=15) == []


def test_each_test_over_its_budget_is_named_with_the_fix():
    problems = suite_budget.check({"tests/a.py::fast": 0.5, "tests/a.py::slow_one": 31.0, "tests/b.py::t": 16.0},
                                  wall_s=300, wall_budget=600, test_budget=15)
    assert len(problems) == 2
    assert problems[0].startswith("tests/a.py::slow_one took 31.0 s")  # slowest first
    assert all("@pytest.mark.slow" in p for p in problems)


def test_a_run_over_its_wall_budget_fails_even_when_every_test_is_short():
    problems = suite_budget.check({f"tests/a.py::t{i}": 5.0 for i in range(300)}, wall_s=750,
                                  wall_budget=600, test_budget=15)
    assert problems == [problems[0]] and "750 s, over its 600 s budget" in problems[0]


def _cache(tmp_path, session, durations):
    d = tmp_path / "v" / "maxtrain"
    d.mkdir(parents=True)
    (d / "session").write_text(json.dumps(session))
    (d / "durations").write_text(json.dumps(durations))
    return str(tmp_path)


def test_main_reads_the_recorded_run_and_exits_1_over_budget(tmp_path, capsys):
    cache = _cache(tmp_path, {"wall_s": 100, "markexpr": "not slow", "args": ["tests"]}, {"tests/a.py::t": 40.0})
    assert suite_budget.main(["--cache", cache]) == 1
    out, err = capsys.readouterr()
    assert "tests/a.py::t" in out and "took 40.0 s" in err


def test_main_refuses_a_run_that_was_not_the_default_one(tmp_path, capsys):
    cache = _cache(tmp_path, {"wall_s": 100, "markexpr": "slow", "args": ["tests"]}, {"tests/a.py::t": 1.0})
    assert suite_budget.main(["--cache", cache]) == 2
    assert "not the default run" in capsys.readouterr().err

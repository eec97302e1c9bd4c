"""Holds the README's `pytest` (the default run: every test not marked `slow`) to its budget.

    python tests/suite_budget.py [--cache DIR] [--wall-budget 600] [--test-budget 30]

Reads what the last pytest session in this checkout recorded (tests/conftest.py keeps each test's setup + call +
teardown time and the session's wall time in pytest's cache, .pytest_cache/v/maxtrain/) and fails, naming the
tests and the fix, when

  - a test of the default run took longer than --test-budget seconds: mark it `@pytest.mark.slow` (CI runs the
    slow tests in a later stage, .ci/run) or make it cheaper (a smaller model, a shared fixture, an in-process
    call instead of a subprocess);
  - the default run took longer than --wall-budget seconds of wall time (README: at most 10 minutes on 2 cores).

The first rule keeps the default run from growing by tests that each take seconds; the second catches the
rest (many small tests, a slower fixture). It reads only a default run (no `-m` other than "not slow", no test
paths): after any other session it says so and exits 2. .ci/run calls it right after the README's `pytest`;
it prints the 25 slowest tests either way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(cache: str, key: str):
    path = os.path.join(cache, "v", "maxtrain", key)
    if not os.path.exists(path):
        sys.exit(f"suite_budget: error: {path} does not exist; run the README's `pytest` in {REPO} first "
                 "(tests/conftest.py records each test's time there)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check(durations: dict[str, float], wall_s: float, wall_budget: float, test_budget: float) -> list[str]:
    """The budget's violations, one line each (empty when the run fits)."""
    problems = []
    over = sorted(((t, n) for n, t in durations.items() if t > test_budget), reverse=True)
    for t, name in over:
        problems.append(f"{name} took {t:.1f} s in the default run (budget {test_budget:g} s a test): mark it "
                        "@pytest.mark.slow (CI runs it in a later stage) or make it cheaper")
    if wall_s > wall_budget:
        problems.append(f"the default run took {wall_s:.0f} s, over its {wall_budget:g} s budget: mark the slowest "
                        "tests above @pytest.mark.slow, or make them cheaper")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="suite_budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.path.join(REPO, ".pytest_cache"), help="pytest's cache directory")
    parser.add_argument("--wall-budget", type=float, default=600.0, help="seconds of wall time for the default run")
    parser.add_argument("--test-budget", type=float, default=30.0, help="seconds for one test of the default run")
    args = parser.parse_args(argv)

    session = _read(args.cache, "session")
    durations = _read(args.cache, "durations")
    if session.get("markexpr") not in ("", "not slow") or session.get("args") not in ([], ["tests"]) \
            or session.get("keyword"):
        print(f"suite_budget: error: the last pytest session was not the default run (-m {session.get('markexpr')!r}, "
              f"-k {session.get('keyword')!r}, paths {session.get('args')}); run the README's `pytest` first",
              file=sys.stderr)
        return 2
    slowest = sorted(durations.items(), key=lambda kv: -kv[1])[:25]
    print(f"default run: {len(durations)} tests, {session['wall_s']:.0f} s wall time "
          f"(budget {args.wall_budget:g} s), {sum(durations.values()):.0f} s of test time; the 25 slowest:")
    for name, t in slowest:
        print(f"  {t:7.1f} s  {name}")
    problems = check(durations, session["wall_s"], args.wall_budget, args.test_budget)
    for line in problems:
        print(f"suite_budget: error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

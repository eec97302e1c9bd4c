"""scripts/gpu_report.py, the GPU measurement as one prepared command (docs/gpu.md; its logic: maxtrain/gpu_check/),
tested on a CPU:

- the report's budget (observability/report.py): parts within their shares, unused time passed on, items that
  would not fit skipped and listed, errors kept as rows, files rewritten after every item, the watchdog;
- the `device` call the script prints is the one docs/gpu.md shows, and fits the tool's limits; the carried
  wheels' pins sit in pyproject.toml's ranges;
- --dry-run: the whole command on this CPU with tiny shapes (kernels in interpret mode).

tests/gpu_check/test_gpu_report_lowering.py compiles every program the report runs for an H100; tests/gpu_check/test_gpu.py holds
its correctness checks for pytest on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import jax.numpy as jnp
import pytest

from conftest import REPO
from maxtrain.gpu_check import items, plan
from maxtrain.models.attention import kernel_check
from maxtrain.observability import environment
from maxtrain.observability.report import WATCHDOG_EXIT_STATUS, Report
from maxtrain.training import measure


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _report(tmp_path, budget=100.0):
    clock = Clock()
    report = Report(str(tmp_path), budget, "test report", {"command": "x"}, clock=clock, log=lambda *a, **k: None)
    return report, clock


def test_parts_keep_to_their_shares_and_pass_unused_time_on(tmp_path):
    report, clock = _report(tmp_path)
    columns = [("took", "took", "{}")]

    def item(seconds):
        clock.now += seconds
        return {"took": seconds}

    first = report.part("first", 0.2, columns)  # until 20 s
    assert first.run("a", lambda: item(5), kind="k")["took"] == 5
    assert first.run("b", lambda: item(12), kind="k")["seconds"] == 12  # now 17 s: 3 s left
    assert first.run("c", lambda: item(1), kind="k") is None  # the latest "k" (b) took 12 s: skipped
    assert first.run("d", lambda: item(1), kind="cheap", estimate=2) is not None  # a cheaper kind still runs
    assert [s["item"] for s in first.skipped] == ["c"] and "share ran out" in first.skipped[0]["reason"]
    second = report.part("second", 0.3, columns)  # until 50 s: what the first left (2 s) passes on
    assert second.share_seconds == pytest.approx(32) and first.seconds() == pytest.approx(18)
    clock.now = 60  # the second overran: the third gets less than its share
    third = report.part("third", 0.5, columns)
    assert third.share_seconds == pytest.approx(40) and second.seconds() == pytest.approx(42)
    assert third.run("big", lambda: item(1), estimate=41) is None


def test_the_first_item_of_a_kind_does_not_set_the_estimate(tmp_path):
    """The first item of a kind pays the process' one-time costs (on an H200: 73 s, then 3 to 12 s each)."""
    report, clock = _report(tmp_path)

    def item(seconds):
        clock.now += seconds
        return {"took": seconds}

    part = report.part("p", 1.0, [("took", "took", "{}")])  # until 100 s
    part.run("first", lambda: item(70), kind="k", estimate=5)
    assert part.run("second", lambda: item(10), kind="k", estimate=5) is not None  # 30 s left; about 5 s, not 70
    assert part.run("third", lambda: item(5), kind="k", estimate=5) is not None  # 20 s left; about 10 s (the latest)
    assert part.run("fourth", lambda: item(1), kind="k", estimate=16) is None  # 15 s left; the estimate given wins


def test_an_item_that_raises_becomes_a_row_and_the_files_are_rewritten_after_each(tmp_path):
    report, clock = _report(tmp_path)
    part = report.part("p", 1.0, [("value", "value", "{:.2f}")], note="what the part measures")

    def broken():
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore lines")

    part.run("ok", lambda: {"value": 1.5})
    row = part.run("broken", broken)
    assert "RESOURCE_EXHAUSTED: out of memory" in row["error"] and "\n" not in row["error"]
    data = json.loads((tmp_path / "report.json").read_text())
    assert [r["item"] for r in data["parts"][0]["rows"]] == ["ok", "broken"] and not data["finished"]
    markdown = (tmp_path / "report.md").read_text()
    assert "| ok | 1.50 |" in markdown and "failed: RuntimeError: RESOURCE_EXHAUSTED" in markdown
    assert "what the part measures" in markdown and "not finished" in markdown
    part.run("after", lambda: {"value": float("nan")})
    report.finish()
    assert json.loads((tmp_path / "report.json").read_text())["finished"] is True
    assert "| after | nan |" in (tmp_path / "report.md").read_text()


def test_the_watchdog_writes_the_report_and_stops_the_process(tmp_path):
    code = ("import time; from maxtrain.observability.report import Report\n"
            f"r = Report({str(tmp_path)!r}, 0.2, 't', {{}})\n"
            "p = r.part('p', 1.0, [])\n"
            "r.start_watchdog(0.1)\n"
            "p.run('hangs', lambda: time.sleep(30) or {})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == WATCHDOG_EXIT_STATUS, done.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["running"] == "p: hangs" and not data["finished"]
    assert "ran out while running p: hangs" in done.stdout


# ----------------------------------------------------------------------------------------------
# The device call and the wheels


def test_the_device_call_is_printed_documented_and_within_the_tools_limits():
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_report.py"), "--print-device-call"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    call = json.loads(done.stdout)
    assert call == plan.DEVICE_CALL
    assert len(call["command"]) <= 2000 and len(call["carry"]) <= 8
    assert call["timeout_s"] <= 600
    # the budget, the watchdog's grace and ~60 s for installing the wheels and starting JAX
    assert call["timeout_s"] >= plan.BUDGET_SECONDS + plan.WATCHDOG_GRACE_SECONDS + 60
    docs = open(os.path.join(REPO, "docs", "gpu.md"), encoding="utf-8").read()
    assert plan.device_call_text() in docs, "docs/gpu.md must show the call scripts/gpu_report.py prints"
    assert "/.whl/" in open(os.path.join(REPO, ".gitignore"), encoding="utf-8").read().split()


def test_the_carried_wheels_are_pinned_inside_pyprojects_ranges():
    packaging = pytest.importorskip("packaging.requirements")
    pins = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_wheels.sh"), "--list"], capture_output=True,
                          text=True, check=True).stdout.split()
    names = {p.split("==")[0].lower(): p.split("==")[1] for p in pins}
    assert {"grain", "array-record", "tensorboardx", "portpicker", "tokamax", "qwix", "flax"} <= set(names)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    required = [packaging.Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    py312 = {"python_version": "3.12", "python_full_version": "3.12.3"}  # the GPU image's Python
    for req in required:
        if req.name.lower() in names and (req.marker is None or req.marker.evaluate(py312)):
            assert req.specifier.contains(names[req.name.lower()]), (req, names[req.name.lower()])
    folder = os.path.join(REPO, ".whl")
    if os.path.isdir(folder):  # downloaded here (scripts/gpu_wheels.sh): one wheel of each pin, for CPython 3.12
        wheels = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
        found = {w.split("-")[0].replace("_", "-").lower(): w.split("-")[1] for w in wheels}
        assert found == names, f"{folder} holds {wheels}: run scripts/gpu_wheels.sh again"
        assert all(("cp312" in w or "py3-none-any" in w) and ("x86_64" in w or w.endswith("any.whl")) for w in wheels)


# ----------------------------------------------------------------------------------------------
# The command on this CPU


def _run_script(tmp_path, *args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}  # one CPU device, as a user's machine has
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_report.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_without_a_gpu_it_says_how_to_run_it(tmp_path):
    done = _run_script(tmp_path, "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().startswith("gpu_report: error: no GPU here") and "--dry-run" in done.stderr


def test_dependencies_are_checked_against_the_requirement_for_this_python():
    """pyproject.toml names jax once per Python (environment markers); only this Python's line counts."""
    other = "3.11" if sys.version_info >= (3, 12) else "3.12"
    rows = environment.package_versions([f"jax>=0.0.1; python_version == '{sys.version_info.major}.{sys.version_info.minor}'",
                                         f"jax<0.0.1; python_version == '{other}'"])
    assert [(r["package"], r["wanted"], r["ok"]) for r in rows] == [("jax", ">=0.0.1", True)]


def test_dry_run_of_the_environment_part(tmp_path):
    done = _run_script(tmp_path, "--dry-run", "--out", str(tmp_path), "--parts", "environment")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    rows = {r["item"]: r for r in data["parts"][0]["rows"]}
    assert set(rows) == {"device and software", "dependencies", "kernel library", "large matmul"}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["dependencies"]["value"] == "all in pyproject.toml's ranges"
    assert data["finished"] and "## environment" in done.stdout
    assert data["parts"][0]["share_seconds"] > 0.9 * data["budget_seconds"]  # a part alone has the whole budget


@pytest.mark.slow
def test_dry_run_runs_every_part_on_the_cpu(tmp_path):
    """The whole command with tiny shapes: every item runs and passes, except cuDNN's (no GPU here) and
    tokamax's where it cannot run (not installed; its Mosaic GPU kernel in the model)."""
    done = _run_script(tmp_path, "--dry-run", "--out", str(tmp_path), "--budget", "2000", timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert [p["name"] for p in data["parts"]] == list(plan.DEFAULT_PARTS) and data["finished"]
    for part in data["parts"]:
        assert all("error" not in r for r in part["rows"]), (part["name"], part["rows"])
        assert all("cuDNN" in s["reason"] or "tokamax" in s["reason"] for s in part["skipped"]), part["skipped"]
        assert all(r.get("verdict", "PASS") == "PASS" for r in part["rows"]), part["rows"]
    dry = plan.make_plan(dry_run=True)
    counts = {p["name"]: len(p["rows"]) for p in data["parts"]}
    speed = sum(len([i for i in items.speed_impls(dry, t)
                     if i != "cudnn" and (i != "tokamax" or items.tokamax_missing(dry) is None)])
                for _, t in dry.speed_shapes)
    assert counts == {"environment": 4, "kernels": len(dry.kernel_cases), "model": len(dry.model_variants) - 2,
                      "speed": speed, "training": len(dry.training)}
    markdown = (tmp_path / "report.md").read_text()
    assert sum(line.startswith("| --- ") for line in markdown.splitlines()) == len(plan.DEFAULT_PARTS)  # one each


def test_the_checks_catch_a_wrong_mask_and_never_pass_nan():
    """The kernels part's comparison means something: attention with the wrong mask (full instead of causal)
    is far outside the tolerance, and a NaN anywhere fails; likewise for the model part's gradient trees."""
    case = kernel_check.Case(batch=1, length=24, heads=4, kv_heads=1, head_dim=16, dtype="float32")
    q, k, v, seg, do = kernel_check.inputs(case, seed=0)
    causal = kernel_check.fwd_bwd(kernel_check.reference(causal=True))(q, k, v, seg, do)
    full = kernel_check.fwd_bwd(kernel_check.reference(causal=False))(q, k, v, seg, do)
    assert kernel_check.passes(kernel_check.relative_errors(causal, causal), "float32")
    assert min(kernel_check.relative_errors(full, causal).values()) > 10 * kernel_check.TOLERANCE["bfloat16"]
    poisoned = (causal[0].at[0, 0, 0, 0].set(jnp.nan), *causal[1:])
    errors = kernel_check.relative_errors(poisoned, causal)
    assert errors["out"] == float("inf") and not kernel_check.passes(errors, "float32")
    tree = {"a": jnp.ones(3), "b": jnp.arange(4.0)}
    assert measure.relative_tree_errors(tree, tree)["grads"] == 0
    off = measure.relative_tree_errors({"a": jnp.ones(3), "b": jnp.arange(4.0) * 1.1}, tree)
    assert off["worst_leaf"] == "['b']" and off["worst_leaf_error"] == pytest.approx(0.1)
    assert measure.relative_tree_errors({"a": jnp.full(3, jnp.nan), "b": jnp.arange(4.0)}, tree)["grads"] == float("inf")

"""scripts/benchmark.py --compare (maxtrain/training/benchmark.py): variants built in one process, their steps timed
alternately."""

import json

import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain.training import benchmark
COMMON = [BASE_YML, *TINY, "dataset_type=synthetic"]


def test_compare_times_each_variant_alternately_in_one_process(tmp_path, capsys):
    out = tmp_path / "compare.jsonl"
    results = benchmark.run([*COMMON, "--steps", "3", "--warmup", "1", "--json", str(out),
                             "--compare", "remat_policy=none", "--compare", "remat_policy=full num_vocab_tiling=2"])
    assert [r["variant"] for r in results] == ["remat_policy=none", "remat_policy=full num_vocab_tiling=2"]
    for r in results:
        assert r["timed_steps"] == 3 and r["warmup_steps"] == 1
        assert r["step_seconds_median"] > 0 and r["cpu_seconds_per_step_median"] > 0
        assert r["step_seconds_p25"] <= r["step_seconds_median"]
        assert r["compiled_memory_bytes"] > 0
    assert results[0]["ratio_to_first"] == 1.0
    assert results[1]["ratio_to_first"] == pytest.approx(
        results[1]["step_seconds_median"] / results[0]["step_seconds_median"])
    # Same model, data and seed: remat and a tiled loss change how the step computes, not what it learns.
    assert results[1]["first_loss"] == pytest.approx(results[0]["first_loss"], rel=1e-5)
    assert results[1]["last_loss"] == pytest.approx(results[0]["last_loss"], rel=1e-4)
    assert results[0]["last_loss"] != results[0]["first_loss"]  # the state advanced: each variant trains its own
    table = capsys.readouterr().out
    assert "one step of each in turn" in table
    assert "remat_policy=full num_vocab_tiling=2" in table and "remat_policy=none" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == [r["variant"] for r in results]
    assert [r["remat_policy"] for r in rows] == ["none", "full"]  # what each variant resolved to


def test_compare_an_empty_variant_is_the_common_settings(capsys):
    results = benchmark.run([*COMMON, "--steps", "2", "--warmup", "0", "--compare", "", "--compare", "remat_policy=full"])
    assert results[0]["variant"] == ""
    assert "(common settings)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--compare", "remat_policy=full"], "two or more variants"),
    (["--compare", "remat_policy=full", "--compare", "remat_policy=none", "--profile", "2"], "without it"),
    (["--compare", "remat_policy=full", "--compare", "remat_policy=none", "--measure-peak"], "without it"),
])
def test_compare_usage_errors_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args([*COMMON, *argv])
    assert message in capsys.readouterr().err


def test_compare_refuses_a_variant_that_sets_steps():
    with pytest.raises(config_lib.ConfigError, match="pass --steps N instead of steps="):
        benchmark.run([*COMMON, "--compare", "", "--compare", "steps=5"])


def test_compare_refuses_variants_in_different_processes():
    with pytest.raises(config_lib.ConfigError, match="same processes"):
        benchmark.run([*COMMON, "--compare", "",
                       "--compare", "coordinator_address=127.0.0.1:12345 num_processes=1 process_id=0"])


def test_compare_runs_one_step_of_each_in_turn_reversing_the_order(monkeypatch):
    calls, real_build = [], benchmark.build

    def recording_build(config):
        run, step_fn, *rest = real_build(config)
        name = config.remat_policy

        def step(state, batch):
            calls.append(name)
            return step_fn(state, batch)

        step.memory_analysis = step_fn.memory_analysis
        return (run, step, *rest)

    monkeypatch.setattr(benchmark, "build", recording_build)
    benchmark.run([*COMMON, "--steps", "3", "--warmup", "1", "--compare", "remat_policy=none",
                   "--compare", "remat_policy=full"])
    assert calls == ["none", "full", "full", "none", "none", "full", "full", "none"]

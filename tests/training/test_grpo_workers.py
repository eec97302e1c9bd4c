"""GRPO with rollout workers (training/rollout/): on policy with the JAX engine the colocated run's losses bitwise; a
worker killed with SIGKILL restarted by Ray and its prompts re-issued; one step off policy with partial rollouts;
the truncated importance weights; bad inputs."""

import json
import shutil
import sys

import grain
import numpy as np
import pytest

from ckpt_helpers import assert_bitwise_equal
from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import errors
from maxtrain import train
from maxtrain.training.rollout import controller, correction, position, schedule as rollout_schedule
from maxtrain.training.rollout.worker import chunk_seed
import processes
from post_helpers import compose, grpo_args, make_dataset

try:
    import ray
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason="Ray is not installed: pip install 'maxtrain[rl]'")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo_workers")
    paths = make_dataset(str(directory), n=64)
    paths["dir"] = str(directory)
    return paths


def _run(dataset, tmp_path, name, *extra, steps=3):
    return train.main(compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
                              f"run_name={name}", f"steps={steps}", "eval_interval=-1", "learning_rate=1e-2",
                              "enable_checkpointing=false", f"metrics_file={tmp_path}/{name}.jsonl", *extra))


def _logged(tmp_path, name) -> dict:
    lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines if "learning/loss" in m}


@pytest.fixture(scope="module")
def colocated(dataset, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("colocated")
    return _run(dataset, tmp_path, "colocated"), _logged(tmp_path, "colocated")


def _same_steps(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        for key in ("learning/loss", "learning/grpo_reward", "learning/grpo_completion_length", "learning/grpo_kl"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


@needs_ray
@pytest.mark.slow
def test_two_workers_on_policy_give_the_colocated_losses_bitwise(dataset, tmp_path, colocated):
    run, logged = colocated
    workers = _run(dataset, tmp_path, "workers", "grpo_rollout_workers=2")
    metrics = _logged(tmp_path, "workers")
    _same_steps(logged, metrics)
    assert_bitwise_equal(run.state, workers.state, "GRPO state after 3 steps")
    for m in metrics.values():
        assert m["learning/grpo_sync_bytes"] > 0 and m["learning/grpo_staleness_max"] == 0
        assert m["learning/grpo_logp_mismatch_max"] < 1e-4  # the same program's log p against the trainer's forward
        assert "learning/grpo_tis_weight_mean" not in m    # on policy with the JAX engine: no correction
    assert "learning/grpo_sync_bytes" not in logged[1]     # the colocated run syncs nothing


@needs_ray
@pytest.mark.slow
def test_a_worker_killed_mid_run_is_restarted_and_its_prompts_reissued(dataset, tmp_path, colocated, capsys):
    """kill -9 of a worker's process while it generates: Ray restarts it, its batch is sent again, and the run trains
    on exactly the colocated run's prompts and completions (the same losses bitwise): none lost, none twice."""
    killed = []
    thread = processes.kill_a_generating_worker(killed)
    run = _run(dataset, tmp_path, "killed", "grpo_rollout_workers=2")
    thread.join(timeout=5)
    assert killed, "no worker was seen generating"
    assert "died" in capsys.readouterr().out
    metrics = _logged(tmp_path, "killed")
    assert metrics[3]["learning/grpo_reissued_batches"] >= 1
    _same_steps(colocated[1], metrics)
    assert_bitwise_equal(colocated[0].state, run.state, "GRPO state after 3 steps")


@needs_ray
@pytest.mark.slow
def test_one_step_off_policy_with_partial_rollouts(dataset, tmp_path):
    """k = 1 and chunks of 3 tokens: the next step's rollout runs while this one trains, a completion may span two
    versions, no token is more than one version stale, and the update is corrected by capped importance weights."""
    _run(dataset, tmp_path, "async", "grpo_rollout_workers=2", "grpo_off_policy_steps=1",
         "grpo_rollout_chunk_tokens=3", "grpo_tis_cap=2.0", steps=4)
    metrics = _logged(tmp_path, "async")
    assert sorted(metrics) == [1, 2, 3, 4]
    for m in metrics.values():
        assert m["learning/grpo_staleness_max"] <= 1
        assert 0 < m["learning/grpo_tis_weight_max"] <= 2.0
        assert 0 <= m["learning/grpo_tis_capped_fraction"] <= 1
        assert np.isfinite(m["learning/loss"])
    assert max(m["learning/grpo_staleness_max"] for m in metrics.values()) == 1  # later steps use older tokens


@needs_ray
@pytest.mark.slow
def test_a_run_one_step_off_policy_resumes_with_the_prompts_that_were_out(dataset, tmp_path, monkeypatch, capsys):
    """k = 1: the checkpoint at step 2 is saved while step 2's prompt batch is out (issued at step 1). The resumed run
    issues exactly that batch again for step 2, then step 3's: each step trains on the uninterrupted run's prompts,
    none skipped, none twice. Its step 2 is sampled by the restored version 2 (on policy), where the uninterrupted
    run's was sampled by version 1: only the prompts are the same, not the completions."""
    prompts = {}
    begin = rollout_schedule.Rollouts.begin

    def recording(self, step, params):  # the real begin; what it hands the step is written down
        batch = begin(self, step, params)
        prompts.setdefault(step, []).append([t.decode() for t in batch["text"]])
        return batch

    monkeypatch.setattr(rollout_schedule.Rollouts, "begin", recording)
    args = ("grpo_rollout_workers=2", "grpo_off_policy_steps=1", "enable_checkpointing=true", "checkpoint_period=2",
            "max_num_checkpoints_to_keep=3")
    _run(dataset, tmp_path, "k1", *args, steps=4)
    straight = {step: texts[0] for step, texts in prompts.items()}
    assert sorted(straight) == [0, 1, 2, 3] and len({tuple(t) for t in straight.values()}) == 4
    shutil.rmtree(tmp_path / "k1" / "checkpoints" / "4")  # as if killed after saving step 2 (step 2's batch out)
    capsys.readouterr()
    _run(dataset, tmp_path, "k1", *args, steps=4)
    out = capsys.readouterr().out
    assert "Resuming from" in out and "weights version 2 (the state's, restored) published to the 2 workers" in out
    assert [prompts[step][1] for step in (2, 3)] == [straight[2], straight[3]]
    metrics = [json.loads(line) for line in (tmp_path / "k1.jsonl").read_text().splitlines()]
    resumed = [m for m in metrics if "learning/loss" in m][-2:]
    assert [m["step"] for m in resumed] == [3, 4]
    assert resumed[0]["learning/grpo_staleness_max"] == 0  # step 2 sampled by the restored version 2


def test_the_checkpointed_position_is_that_of_the_first_batch_not_trained():
    """position.Position on a Grain iterator of 0, 1, 2, ...: the state after some updates re-reads the batches that
    were out, and passes over those read later but trained (dynamic sampling's further batches of an earlier step)."""
    def fresh():
        return position.Position(iter(grain.MapDataset.range(100).to_iter_dataset()))

    plain = fresh()
    assert [plain.read(0), plain.read(1), plain.read(2)] == [0, 1, 2]  # k = 2: steps 1 and 2 out after step 0
    plain.trained(1)
    state = plain.get_state()
    assert state == {"next_index": 1}  # Grain's own state, as before the batch of step 1 was read
    again = fresh()
    again.set_state(state)
    assert [again.read(1), again.read(2), again.read(3)] == [1, 2, 3]
    mixed = fresh()  # k = 1 with dynamic sampling: b0 b1 e0 | b2 e1 (e: a step's further batch, read after the next's)
    assert [mixed.read(0), mixed.read(1), mixed.read(0), mixed.read(2), mixed.read(1)] == [0, 1, 2, 3, 4]
    mixed.trained(2)
    state = mixed.get_state()
    assert state == {"parent": {"next_index": 3}, "trained_reads": [1]}
    resumed = fresh()
    resumed.set_state(state)
    assert resumed.get_state() == state  # saved again before reading: the same position
    assert [resumed.read(2), resumed.read(3)] == [3, 5]
    everything = fresh()
    assert [everything.read(0), everything.read(0)] == [0, 1]
    everything.trained(1)
    assert everything.get_state() == {"next_index": 2}


def test_truncated_importance_weights_against_their_formula():
    rng = np.random.default_rng(0)
    trainer, engine = rng.normal(-2, 0.5, (2, 3, 7)), rng.normal(-2, 0.5, (2, 3, 7))
    mask = (rng.random((2, 3, 7)) > 0.3).astype(np.float32)
    weights, m = correction.tis_weights(trainer, engine, mask, 1.5)
    expected = np.where(mask > 0, np.minimum(np.exp(trainer - engine), 1.5), 0.0)
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    on = mask > 0
    assert m["aux/grpo_tis_capped_fraction"] == pytest.approx((np.exp(trainer - engine)[on] > 1.5).mean())
    assert m["aux/grpo_logp_mismatch_max"] == pytest.approx(np.abs(trainer - engine)[on].max())
    assert m["aux/grpo_tis_weight_max"] == pytest.approx(1.5)


def test_a_chunk_seed_is_the_request_seed_first_and_differs_after():
    assert chunk_seed(12345, 0) == 12345
    assert len({chunk_seed(12345, c) for c in range(5)}) == 5 and all(0 <= chunk_seed(2**64 - 1, c) < 2**64
                                                                         for c in range(5))


def _refused(dataset, tmp_path, *extra):
    return train.main(compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
                              "run_name=bad", "steps=1", *extra))


def test_workers_without_ray_name_the_extra(dataset, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it fails
    with pytest.raises(config_lib.ConfigError, match=r"grpo_rollout_workers=2 runs its workers on Ray, which is not "
                                                      r"installed; pip install 'maxtrain\[rl\]'"):
        _refused(dataset, tmp_path, "grpo_rollout_workers=2")


@needs_ray
def test_the_vllm_engine_without_vllm_is_refused_by_the_trainer_with_its_install(dataset, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (it is not in the test extras' virtualenv)
    with pytest.raises(errors.MissingPackage, match=r"^grpo_rollout_engine=vllm needs the vllm package: a virtualenv "
                                                   r"of its own .*scripts/make_vllm_venv.sh, or set "
                                                   r"grpo_rollout_engine=jax$"):
        _refused(dataset, tmp_path, "grpo_rollout_workers=1", "grpo_rollout_engine=vllm")
    assert not ray.is_initialized()  # refused in the trainer, before Ray started any worker


@needs_ray  # the address is probed once Ray is known to be installed (config/objectives.py)
def test_an_unreachable_ray_address_is_named(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(config_lib.ConfigError, match=r"RAY_ADDRESS=127.0.0.1:1 cannot be reached"):
        _refused(dataset, tmp_path, "grpo_rollout_workers=1")


def test_workers_ask_ray_for_the_accelerators_the_cluster_has_and_a_cluster_too_small_is_named():
    def options(devices, resources, workers=2):
        config = type("C", (), {"grpo_rollout_workers": workers, "grpo_rollout_worker_devices": devices})
        return controller.placement(config, resources, "10.0.0.1:6379")

    assert options(0, {"CPU": 4.0}) == {"num_cpus": 1}
    assert options(2, {"CPU": 64.0, "GPU": 8.0}) == {"num_cpus": 1, "num_gpus": 2}
    assert options(4, {"CPU": 64.0, "TPU": 8.0, "memory": 1e12}) == {"num_cpus": 1, "resources": {"TPU": 4}}
    with pytest.raises(errors.ConfigError, match=r"^grpo_rollout_worker_devices=1 asks Ray for 1 accelerators per "
                                                 r"rollout worker, but the Ray cluster at 10.0.0.1:6379 has none "
                                                 r"\(CPU 4\); set grpo_rollout_worker_devices=0"):
        options(1, {"CPU": 4.0, "memory": 1e9})
    with pytest.raises(errors.ConfigError, match=r"^grpo_rollout_workers=3 x grpo_rollout_worker_devices=4 = 12 GPUs, "
                                                 r"but the Ray cluster at 10.0.0.1:6379 has 8; set fewer workers"):
        options(4, {"CPU": 64.0, "GPU": 8.0}, workers=3)
    with pytest.raises(errors.ConfigError, match=r"^grpo_rollout_workers=3 workers need one CPU each, but the Ray "
                                                 r"cluster at 10.0.0.1:6379 has CPU 2; set grpo_rollout_workers <= 2"):
        options(0, {"CPU": 2.0}, workers=3)


@pytest.mark.slow  # starts a local Ray
@needs_ray
def test_accelerators_this_machine_lacks_are_refused_before_any_worker_starts(dataset, tmp_path):
    with pytest.raises(errors.ConfigError, match=r"grpo_rollout_worker_devices=1 asks Ray for 1 accelerators per "
                                                 r"rollout worker, but the local Ray \(this machine\) has none"):
        _refused(dataset, tmp_path, "grpo_rollout_workers=1", "grpo_rollout_worker_devices=1")
    assert not ray.is_initialized()  # the Ray the run started is stopped again

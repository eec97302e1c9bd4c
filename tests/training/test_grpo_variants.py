"""GRPO's advantage variants and rollout batches: each estimator and scaling against hand-computed numbers, DAPO's
overlong shaping against TRL's function, truncated completions masked, dynamic sampling refilling its batch on a real
tiny run (and resuming exactly), and several updates per rollout batch with pi_old held fixed."""

import json
import shutil

import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import train
from maxtrain.training import advantages, grpo, loop
from post_helpers import compose, grpo_args, make_dataset

EPS = 1e-4


def test_each_estimator_and_scaling_against_hand_computed_numbers():
    """Group 1 = [1, 0, 0, 0]: mean 1/4, sum of squared deviations 3/4, so the population std is sqrt(3/16) and the
    sample std sqrt(1/4) = 1/2. Group 2 = [2, 2, 2, 2]: all equal. All 8: mean 9/8, squared deviations
    (1/8)^2 + 3 (9/8)^2 + 4 (7/8)^2 = 440 / 64 = 6.875."""
    r = np.array([1.0, 0, 0, 0, 2, 2, 2, 2])
    hand = {
        ("grpo", "group", 0): [0.75 / (np.sqrt(3 / 16) + EPS)] + [-0.25 / (np.sqrt(3 / 16) + EPS)] * 3 + [0] * 4,
        ("grpo", "group", 1): [0.75 / (0.5 + EPS)] + [-0.25 / (0.5 + EPS)] * 3 + [0] * 4,
        ("grpo", "batch", 0): [0.75 / (np.sqrt(6.875 / 8) + EPS)] + [-0.25 / (np.sqrt(6.875 / 8) + EPS)] * 3 + [0] * 4,
        ("grpo", "batch", 1): [0.75 / (np.sqrt(6.875 / 7) + EPS)] + [-0.25 / (np.sqrt(6.875 / 7) + EPS)] * 3 + [0] * 4,
        ("grpo", "none", 0): [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0],
        # RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other three: 1 - 0 and 0 - 1/3
        ("rloo", "none", 0): [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0],
        ("rloo", "group", 1): [1.0 / (0.5 + EPS)] + [-1 / 3 / (0.5 + EPS)] * 3 + [0] * 4,
    }
    for (estimator, scale, ddof), want in hand.items():
        got = advantages.advantages(r, 4, estimator, scale, ddof)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"{estimator} {scale} ddof={ddof}")
    # the defaults are GRPO's advantages as maxtrain computed them before these settings (population std)
    np.testing.assert_array_equal(advantages.advantages(r, 4), advantages.advantages(r, 4, "grpo", "group", 0))
    # at 4 generations ddof=0's advantages are 1.155x ddof=1's (TRL's: test_trls_group_std_is_the_sample_std)
    ratio = advantages.advantages(r, 4, ddof=0)[0] / advantages.advantages(r, 4, ddof=1)[0]
    assert abs(ratio - np.sqrt(4 / 3)) < 1e-3 and round(float(ratio), 3) == 1.155


def test_trls_group_std_is_the_sample_std():
    """TRL's group std (its nanstd) is ddof=1's: grpo_reward_std_ddof=1 gives TRL's advantages."""
    torch = pytest.importorskip("torch", reason="TRL needs torch (the [hf] extra)")
    nanstd = pytest.importorskip("trl.trainer.utils", reason="trl is not installed (the [hf] extra)").nanstd
    r = np.array([1.0, 0, 0, 0])
    np.testing.assert_allclose(float(nanstd(torch.tensor(r))), 0.5)
    np.testing.assert_allclose(advantages.advantages(r, 4, ddof=1), (r - 0.25) / (0.5 + EPS), rtol=1e-6)


def test_rloo_baseline_is_the_papers_leave_one_out_mean_on_random_rewards():
    rng = np.random.default_rng(0)
    r = rng.normal(size=5 * 6)
    got = advantages.advantages(r, 6, "rloo", "none")
    want = [r[i] - np.mean(np.delete(r[i // 6 * 6:(i // 6 + 1) * 6], i % 6)) for i in range(30)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_overlong_shaping_equals_trls_soft_overlong_punishment():
    pytest.importorskip("torch", reason="TRL needs torch (the [hf] extra)")
    get_soft_overlong_punishment = pytest.importorskip(
        "trl.rewards", reason="trl is not installed (the [hf] extra)").get_soft_overlong_punishment
    lengths = np.arange(0, 20)  # up to past the limit: TRL's -1 beyond it
    trl = get_soft_overlong_punishment(max_completion_len=16, soft_punish_cache=4)([[7] * n for n in lengths])
    np.testing.assert_allclose(advantages.overlong_penalty(lengths, 16, 4), trl, rtol=0, atol=1e-12)
    assert trl[12] == 0 and trl[14] == -0.5 and trl[16] == -1  # the ramp really is exercised
    # verl's factor scales it; no buffer is no shaping
    np.testing.assert_allclose(advantages.overlong_penalty([12, 13, 16], 16, 4, 0.5), [0, -0.125, -0.5])
    np.testing.assert_array_equal(advantages.overlong_penalty([5, 16], 16, 0), [0, 0])


def test_all_equal_groups_are_found_and_truncated_completions_masked():
    assert advantages.varied_groups(np.array([1.0, 1, 1, 0, 2, 2, 2, 2]), 4).tolist() == [True, False]
    tokens = np.array([[5, 6, 2, 9], [5, 5, 5, 5]], np.int32)
    kept, stopped = grpo.cut(tokens, (2,))
    batch = grpo.assemble([np.array([1, 4], np.int32)] * 2, tokens, np.zeros(tokens.shape, np.float32), kept,
                          np.ones(2, np.float32), 8, (1, 2))
    assert batch["loss_weights"][0, 1].sum() == 4
    masked = grpo.mask_truncated(batch, stopped)
    assert masked["loss_weights"][0, 0].sum() == 3 and masked["loss_weights"][0, 1].sum() == 0  # no stop: weight 0


def test_a_stop_waits_for_the_end_of_the_rollout_batch():
    class Signalled:
        closed = False

        def reached(self, step):
            return step >= 5

        def close(self):
            self.closed = True

    inner = Signalled()
    preemption = grpo.AtRolloutEnds(inner, 4)
    assert [preemption.reached(s) for s in range(4, 10)] == [False, False, False, False, True, False]
    preemption.close()
    assert inner.closed


# --------------------------------------------------------------------------------------------
# Real tiny runs
# --------------------------------------------------------------------------------------------

REWARDS = """
def parity(prompts, completions, answers):
    # every completion of an even sum scores 1 (a group that teaches nothing); odd sums score their length
    return [1.0 if int(a) % 2 == 0 else float(len(c)) for c, a in zip(completions, answers)]


def constant(prompts, completions, answers):
    return [1.0] * len(completions)
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo_variants")
    paths = make_dataset(str(directory), n=64)
    paths["dir"] = str(directory)
    (directory / "grpo_variant_rewards.py").write_text(REWARDS)
    return paths


@pytest.fixture
def on_path(dataset, monkeypatch):
    monkeypatch.syspath_prepend(dataset["dir"])


def _run(dataset, tmp_path, name, *extra):
    return train.main(compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
                              f"run_name={name}", "eval_interval=-1", "learning_rate=1e-2",
                              f"metrics_file={tmp_path}/{name}.jsonl", *extra))


def _logged(tmp_path, name) -> dict:
    lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines if "learning/loss" in m}


@pytest.mark.slow
def test_dynamic_sampling_refills_the_batch_and_resumes_exactly(dataset, tmp_path, on_path):
    """Even sums score alike: their groups are dropped and more prompts drawn until the 2 groups a step needs vary;
    a run resumed after step 1 reads the prompts the first run read at step 2 (the iterator's position counts every
    prompt drawn)."""
    common = ["grpo_reward_functions=[grpo_variant_rewards:parity]", "grpo_dynamic_sampling=true", "steps=2",
              "checkpoint_period=1", "learning_rate_schedule_steps=2"]
    a = _run(dataset, tmp_path, "a", *common)
    logged = _logged(tmp_path, "a")
    for m in logged.values():
        assert m["learning/grpo_groups_drawn"] - m["learning/grpo_groups_dropped"] == 2
        assert m["learning/grpo_reward_std"] > 0  # no kept group scored alike
    assert sum(m["learning/grpo_groups_dropped"] for m in logged.values()) > 0  # some groups were dropped and refilled
    shutil.copytree(tmp_path / "a" / "checkpoints" / "1", tmp_path / "b" / "checkpoints" / "1")
    b = _run(dataset, tmp_path, "b", *common)
    assert sorted(_logged(tmp_path, "b")) == [2]
    assert _logged(tmp_path, "b")[2]["learning/loss"] == logged[2]["learning/loss"]
    assert _logged(tmp_path, "b")[2]["learning/grpo_groups_drawn"] == logged[2]["learning/grpo_groups_drawn"]
    np.testing.assert_array_equal(np.asarray(a.state["step"]), np.asarray(b.state["step"]))


@pytest.mark.slow  # ~40 s on 2 cores: the train step compiles before the first rollout
def test_dynamic_sampling_out_of_its_budget_says_how_many_groups_scored_alike(dataset, tmp_path, on_path):
    with pytest.raises(loop.TrainingError, match=r"grpo_dynamic_sampling: at step 1, 4 of the 4 groups in 2 prompt "
                                                 r"batches had all-equal rewards, leaving 0 of the 2 groups a step "
                                                 r"needs \(grpo_dynamic_sampling_max_batches=2\); raise"):
        _run(dataset, tmp_path, "c", "grpo_reward_functions=[grpo_variant_rewards:constant]",
             "grpo_dynamic_sampling=true", "grpo_dynamic_sampling_max_batches=2", "steps=1")


@pytest.mark.slow
def test_several_updates_per_rollout_batch_hold_pi_old_fixed(dataset, tmp_path, on_path):
    """grpo_num_iterations=2: the first update of a rollout batch has ratio pi / pi_old = 1 (pi_old is the trainer's
    own log-probabilities under the same weights), the second, on the same completions after one update, does not;
    the next rollout batch starts at 1 again. Its completions are sampled once: the rollout metrics repeat."""
    _run(dataset, tmp_path, "iter", "grpo_reward_functions=[grpo_variant_rewards:parity]", "grpo_num_iterations=2",
         "steps=4", "checkpoint_period=2", "learning_rate_schedule_steps=4")
    logged = _logged(tmp_path, "iter")
    ratio = {s: m["learning/grpo_log_ratio"] for s, m in logged.items()}
    assert ratio[1] == 0.0 and ratio[3] == 0.0, ratio
    assert abs(ratio[2]) > 1e-6 and abs(ratio[4]) > 1e-6, ratio
    assert logged[1]["learning/grpo_reward"] == logged[2]["learning/grpo_reward"]
    assert logged[2]["learning/grpo_rollout_seconds"] == 0.0 < logged[3]["learning/grpo_rollout_seconds"]
    assert logged[1]["learning/grpo_clip_fraction"] == 0.0


@pytest.mark.slow
def test_mini_batches_of_one_rollout_batch_use_the_trainers_pi_old(dataset, tmp_path, on_path):
    """grpo_steps_per_generation=2: both mini-batches are sampled by the step-1 weights; the second is trained after
    one update, so its ratio is not 1, and its pi_old is the trainer's log-probabilities, not the sampler's."""
    _run(dataset, tmp_path, "mini", "grpo_reward_functions=[grpo_variant_rewards:parity]",
         "grpo_steps_per_generation=2", "steps=2", "checkpoint_period=2", "learning_rate_schedule_steps=2")
    logged = _logged(tmp_path, "mini")
    assert logged[1]["learning/grpo_log_ratio"] == 0.0 and abs(logged[2]["learning/grpo_log_ratio"]) > 1e-6

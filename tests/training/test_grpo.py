"""GRPO: the loss and its gradient against numpy, the sampler's log-probabilities against the training
forward pass, rollouts into update batches, a run under FSDP x TP resumed bitwise, and bad inputs."""

import json
import re
import shutil
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckpt_helpers import assert_bitwise_equal
from conftest import BASE_YML, TINY, slow_params
from maxtrain import config as config_lib
from maxtrain import train
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.data import DataError
from maxtrain.models import sampling
from maxtrain.training import grpo, loop, losses, rewards, train_step
from post_helpers import compose, grpo_args, make_dataset, write_jsonl


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo")
    paths = make_dataset(str(directory), n=64)
    paths["dir"] = str(directory)
    return paths


def _numpy_grpo(log_p, old, ref, adv, w, beta, eps):
    """The loss (mean over weighted tokens) and its gradient in log_p, written out by hand."""
    r = np.exp(log_p - old)
    unclipped, clipped = r * adv, np.clip(r, 1 - eps, 1 + eps) * adv
    d = ref - log_p
    loss = -np.minimum(unclipped, clipped) + beta * (np.exp(d) - d - 1)
    # d/dlog_p: -r A where the unclipped term is the minimum (the clipped one is flat there), and
    # beta (1 - exp(ref - log_p)) from k3
    grad = np.where(unclipped <= clipped, -r * adv, 0.0) + beta * (1 - np.exp(d))
    return (loss * w).sum() / w.sum(), grad * w / w.sum()


def test_grpo_loss_and_gradient_equal_numpy():
    rng = np.random.default_rng(0)
    shape = (3, 7)
    log_p = rng.normal(-2.0, 0.5, shape)
    old = log_p + rng.normal(0.0, 0.3, shape)  # ratios on both sides of the clip range
    ref = log_p + rng.normal(0.0, 0.5, shape)
    adv = np.repeat(rng.normal(0.0, 1.0, (3, 1)), 7, axis=1)
    w = (rng.random(shape) > 0.3).astype(np.float64)
    beta, eps = 0.04, 0.2

    def mean_loss(lp):
        loss, _, _ = losses.grpo_token_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
                                                jnp.asarray(adv, jnp.float32), beta, eps)
        return jnp.sum(loss * w) / jnp.sum(w)

    value, grad = jax.value_and_grad(mean_loss)(jnp.asarray(log_p, jnp.float32))
    want, want_grad = _numpy_grpo(log_p, old, ref, adv, w, beta, eps)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    assert 0 < np.mean(np.abs(log_p - old) > 0.2) < 1  # the batch hits the clipped and the unclipped branches


def _tiny(tmp_path, *extra):
    return config_lib.with_devices(config_lib.load_config(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}",
                                                                   "vocab_size=64", *extra)), 1)


@pytest.mark.parametrize("temperature", slow_params([1.0, 0.5], {"1.0"}))
def test_sampled_log_probs_equal_the_training_forward_pass(tmp_path, temperature):
    """Left-padded prompts of different lengths: the sampler's log p(token) = the training pass's, to 1e-5,
    both softmax(logits / T) at the sampling temperature T (else the update would be off-policy)."""
    config = _tiny(tmp_path, "decode_sampling_strategy=weighted", f"decode_sampling_temperature={temperature}")
    rt = Runtime.from_config(config, "cpu")
    params = Model.bind(config).init_params(jax.random.key(1))
    prompts = [np.array([1, 5, 9, 12, 7], np.int32), np.array([1, 30], np.int32), np.array([1, 4, 4], np.int32)]
    length, new = 6, 8
    ids, first = grpo.left_padded([grpo.prompts_lib.Prompt(p, "", "") for p in prompts], length)
    tokens, log_probs = jax.device_get(sampling.sample_completions(
        params, ids, first, jax.random.key(3), model=Model.bind(config), rt=rt, max_new_tokens=new,
        **sampling.sampling_settings(config)))
    kept = np.full(3, new, np.int32)
    batch = grpo.assemble(prompts, tokens, log_probs, kept, np.ones(3, np.float32), 16, (1, 3))
    batch = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    recomputed, _ = jax.jit(lambda p, b: losses.target_log_probs(p, b, Model.bind(config), rt, temperature))(params, batch)
    w = np.asarray(batch["loss_weights"]) > 0
    assert w.sum() == 3 * new
    np.testing.assert_allclose(np.asarray(recomputed)[w], np.asarray(batch["old_log_probs"])[w], atol=1e-5)
    # the objective scores the completions at the sampling temperature: the ratio pi / pi_old is 1
    _, _, metrics = losses.grpo(params, batch, params, Model.bind(config), rt)
    assert abs(float(metrics["grpo_log_ratio"])) < 1e-5 and abs(float(metrics["grpo_kl"])) < 1e-6
    # the same key and prompts sample the same completions (rollouts are a function of the seed and step)
    again, _ = sampling.sample_completions(params, ids, first, jax.random.key(3), model=Model.bind(config), rt=rt,
                                           max_new_tokens=new, **sampling.sampling_settings(config))
    np.testing.assert_array_equal(np.asarray(again), tokens)


def test_completions_are_cut_at_their_stop_and_masked_into_update_rows():
    tokens = np.array([[5, 6, 2, 9], [5, 5, 5, 5], [7, 3, 8, 8]], np.int32)  # stop ids 2 and 3
    kept, stopped = grpo.cut(tokens, (2, 3))
    assert kept.tolist() == [3, 4, 2] and stopped.tolist() == [True, False, True]
    adv = grpo.advantages(np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3)
    np.testing.assert_allclose(adv[:3], np.array([2, -1, -1]) / (np.sqrt(2) + grpo.ADVANTAGE_EPS / np.std([1, 0, 0])),
                               rtol=1e-4)
    np.testing.assert_array_equal(adv[3:], 0.0)  # a group that scored alike teaches nothing
    prompt = [np.array([1, 4], np.int32)] * 3
    batch = grpo.assemble(prompt, tokens, np.full(tokens.shape, -0.5, np.float32), kept, adv[:3], 8, (1, 3))
    w = batch["loss_weights"][0]
    assert w.tolist()[0] == [0, 1, 1, 1, 0, 0, 0, 0]   # prompt 1 4 -> targets 4 (prompt), 5 6 2 (completion)
    assert w.tolist()[2] == [0, 1, 1, 0, 0, 0, 0, 0]
    assert batch["inputs"][0, 0].tolist()[:5] == [1, 4, 5, 6, 0] and batch["targets"][0, 0].tolist()[:4] == [4, 5, 6, 2]
    assert (batch["old_log_probs"][0][w == 0] == 0).all() and (batch["old_log_probs"][0][w > 0] == -0.5).all()


def test_lora_keeps_no_second_copy_of_the_weights(tmp_path):
    with_lora = _tiny(tmp_path, "objective=grpo", "lora_rank=4", "train_data_columns=[prompt,answer]",
                      "eval_data_columns=[prompt,answer]", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                      "decode_sampling_strategy=weighted", "max_prefill_predict_length=16")
    assert set(train_step.state_specs(with_lora, Model.bind(with_lora))) == {"params", "lora"}  # the reference is the frozen base
    state = {"params": {"w": 1}, "lora": {"a": 2}}
    assert train_step.reference_params(state) is state["params"]
    without = _tiny(tmp_path, "objective=grpo", "train_data_columns=[prompt,answer]", "eval_data_columns=[prompt,answer]",
                    "dataset_type=jsonl", "grain_train_files=x.jsonl", "decode_sampling_strategy=weighted",
                    "max_prefill_predict_length=16")
    assert set(train_step.state_specs(without, Model.bind(without))) == {"params", "reference"}


@pytest.mark.slow
def test_grpo_under_fsdp_and_tp_resumes_bitwise(dataset, tmp_path, monkeypatch):
    """2 steps straight, and the second again from the first's checkpoint: the same rollouts, metrics and state.
    The reward (a user function: the completion's length in characters) differs within groups, so the model moves."""
    (tmp_path / "grpo_test_rewards.py").write_text(
        "def length(prompts, completions, answers):\n    return [len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    common = [*grpo_args(dataset, dataset["dir"]), "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
              "eval_interval=-1", "learning_rate_schedule_steps=2", "checkpoint_period=1", "learning_rate=1e-2",
              "grpo_reward_functions=[exact_match,grpo_test_rewards:length]"]

    def run(name, steps):
        return train.main(compose(BASE_YML, *TINY, *common, f"base_output_directory={tmp_path}", f"run_name={name}",
                                  f"steps={steps}", f"metrics_file={tmp_path}/{name}.jsonl"))

    def logged(name):
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return {m["step"]: (m["learning/loss"], m["learning/grpo_reward"], m["learning/grpo_completion_length"],
                            m["learning/grpo_kl"]) for m in lines if "learning/loss" in m}

    a = run("a", 2)
    # run b starts where a stood after step 1 (its checkpoint: params, optimizer, the prompts read so far)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "1", tmp_path / "b" / "checkpoints" / "1")
    b = run("b", 2)
    assert sorted(logged("b")) == [2]  # b resumed: it ran step 2 only
    assert_bitwise_equal(a.state, b.state, "final GRPO state")

    assert logged("a")[2] == logged("b")[2]
    assert all(np.isfinite(v).all() for v in logged("a").values())
    assert "reference" in a.state  # grpo_beta > 0 without LoRA: the frozen starting model
    assert logged("a")[1][0] != 0 and logged("a")[2][3] > 0  # a policy loss; step 2 has moved away from the reference


def _run(dataset, tmp_path, *extra):
    return train.main(compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
                              "run_name=bad", "steps=1", *extra))


@pytest.mark.parametrize("extra, error, match", [
    (["num_generations=1"], config_lib.ConfigError, "num_generations=1: GRPO's advantage"),
    (["decode_sampling_strategy=greedy"], config_lib.ConfigError, "would all be the same"),
    (["train_data_columns=[prompt]"], config_lib.ConfigError, r"set train_data_columns=\[prompt,answer\]"),
    (["use_sft=true"], config_lib.ConfigError, "use_sft=true contradicts objective=grpo: a run has one objective"),
    (["max_prefill_predict_length=24"], config_lib.ConfigError, "leaves no room for a completion"),
    (["max_prefill_predict_length=4"], DataError, "more than max_prefill_predict_length=4"),
    (["grpo_reward_functions=[no_such_module_xyz:score]"], rewards.RewardError, "cannot be imported"),
    (["grpo_reward_functions=[grpo_bad_rewards:missing]"], rewards.RewardError, "has no function 'missing'"),
    (["grpo_reward_functions=[grpo_bad_rewards:scalar]"], rewards.RewardError,
     r"'grpo_bad_rewards:scalar' returned one number \(1.0\) for \d+ completions \(made-up completions"),
    (["grpo_reward_functions=[grpo_bad_rewards:trl]"], rewards.RewardError, r"looks written for TRL's GRPOTrainer"),
    (["grpo_reward_functions=[exact]"], config_lib.ConfigError, "neither a built-in reward"),
    (["num_generations=3"], config_lib.ConfigError,
     "not a multiple of num_generations=3"),
    # on every process, at config time: before joining the others or reading any data
    (["num_processes=2", "process_id=1", "coordinator_address=127.0.0.1:1"], config_lib.ConfigError,
     r"objective=grpo samples in the trainer's one process \(grpo_rollout_workers=0\), but num_processes=2; set "
     r"grpo_rollout_workers >= 1 .*or run it without a coordinator"),
])
def test_bad_inputs_stop_before_any_work(dataset, tmp_path, monkeypatch, extra, error, match):
    (tmp_path / "grpo_bad_rewards.py").write_text("def scalar(prompts, completions, answers):\n    return 1.0\n\n\n"
                                                  "def trl(completions, answer, **kwargs):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(error, match=match):
        _run(dataset, tmp_path, *extra)
    sys.modules.pop("grpo_bad_rewards", None)


def test_grpo_over_processes_the_environment_names_is_refused_before_joining_them(dataset, tmp_path, monkeypatch):
    """The processes set by environment variables (no config key): refused before distributed start-up, which
    would wait for the other process at an address nobody serves."""
    monkeypatch.setenv("MAXTRAIN_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("MAXTRAIN_NUM_PROCESSES", "2")
    monkeypatch.setenv("MAXTRAIN_PROCESS_ID", "1")
    with pytest.raises(config_lib.ConfigError, match=r"objective=grpo samples in the trainer's one process .*, but num_processes=2"):
        _run(dataset, tmp_path)


def test_a_missing_answer_names_the_record(dataset, tmp_path):
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"prompt": "1+1="}])
    with pytest.raises(DataError, match=r"bad.jsonl line 1: a GRPO row needs 'prompt' and 'answer'"):
        _run(dataset, tmp_path, f"grain_train_files={bad}")


USER_REWARDS = """
def trl(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def trl_kwargs(prompts, completions, **kwargs):
    return [float(c == a) for c, a in zip(completions, kwargs["answer"])]


def positional(p, c, a):
    return [0.0] * len(c)


def scalar(prompts, completions, answers):
    return 1.0


def first_only(prompts, completions, answers):
    return [float(completions[0] == answers[0])]


def one_short(prompts, completions, answers):
    return [1.0] * (len(completions) - 1)


def nothing(prompts, completions, answers):
    pass


def not_a_number(prompts, completions, answers):
    return [float("nan")] * len(completions)


def text(prompts, completions, answers):
    return ["1"] * len(completions)


def per_character(prompts, completions, answers):
    return [1.0 / len(c) for c in completions]


def length(prompts, completions, answers, **kwargs):
    return [len(c) for c in completions]
"""


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A module of reward functions, grpo_user_rewards, importable for the test."""
    (tmp_path / "grpo_user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield str(tmp_path / "grpo_user_rewards.py")
    sys.modules.pop("grpo_user_rewards", None)


@pytest.mark.parametrize("function, match", [
    ("trl", r"'grpo_user_rewards:trl' is trl\(completions, answer, \*\*kwargs\), which maxtrain cannot call as "
            r"fn\(prompts=\[...\], completions=\[...\], answers=\[...\]\) .* It looks written for TRL's GRPOTrainer.* "
            r"define it as def score\(prompts, completions, answers, \*\*kwargs\)"),
    ("positional", r"'grpo_user_rewards:positional' is positional\(p, c, a\), which maxtrain cannot call .* Define it "
                   r"as def score\(prompts, completions, answers, \*\*kwargs\)"),
])
def test_a_reward_that_maxtrain_cannot_call_is_refused_when_imported(user_rewards, function, match):
    with pytest.raises(rewards.RewardError, match=match):
        rewards.load([f"grpo_user_rewards:{function}"])
    names = ["exact_match", "grpo_user_rewards:length"]
    assert list(rewards.load(names)) == names


@pytest.mark.parametrize("function, match", [
    ("scalar", r"returned one number \(1.0\) for 8 completions \(made-up completions .*\); it must return 8 numbers"),
    ("first_only", r"returned 1 number for 8 completions"),
    ("one_short", r"returned 7 numbers for 8 completions"),
    ("nothing", r"returned None for 8 completions"),
    ("not_a_number", r"returned a non-finite reward \(nan\) for completion 0 of 8"),
    ("text", r"returned \['1', '1', .*\] \(a list of str\) for 8 completions"),
    ("trl_kwargs", r"raised KeyError: 'answer' at .*grpo_user_rewards.py:7 in trl_kwargs on completion 0 of 8 .* It "
                   r"looks written for TRL's GRPOTrainer"),
    ("per_character", r"raised ZeroDivisionError: float division by zero at .*grpo_user_rewards.py:\d+ in "
                      r"(<listcomp>|per_character) on completion 3 of 8 \(''\)"),
])
def test_the_check_before_compiling_calls_each_reward_on_several_made_up_completions(user_rewards, function, match):
    """Two prompts, four distinct made-up completions each: every way of not returning one number per completion
    is refused with the reward's name and what it returned."""
    functions = rewards.load([f"grpo_user_rewards:{function}"])
    with pytest.raises(rewards.RewardError, match=rf"grpo_reward_functions: 'grpo_user_rewards:{function}' {match}") \
            as caught:
        rewards.check(functions, ["1+1=", "2+2="], ["2", "4"])
    assert "\n" not in str(caught.value)
    rewards.check(rewards.load(["exact_match", "format", "grpo_user_rewards:length"]), ["1+1="], [""])


def test_a_reward_that_raises_in_training_names_itself_the_completion_and_the_line(user_rewards):
    """One line with the reward, the user's exception and the line of their file; the exception stays chained."""
    functions = rewards.load(["exact_match", "grpo_user_rewards:per_character"])
    with pytest.raises(rewards.RewardError) as caught:
        rewards.score(functions, ["p"] * 4, ["abc", "a", "", "b"], ["a"] * 4, context=" at step 7")
    line = str(caught.value)
    assert re.fullmatch(r"grpo_reward_functions: 'grpo_user_rewards:per_character' raised ZeroDivisionError: float "
                        rf"division by zero at {re.escape(user_rewards)}:\d+ in (<listcomp>|per_character) on "
                        r"completion 2 of 4 \(''\) at step 7\. Fix the function .*", line), line
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


def test_a_failed_step_or_hook_finishes_the_checkpoint_saves_under_way():
    """A step that raises (a reward during a GRPO rollout) or a hook that does (the held-out rewards) stops the
    loop with its own error once the saves under way are finished: the steps saved so far stay usable. A save
    that failed itself is not waited for again."""
    events = []

    class Checkpointer:
        def save(self, *args):
            events.append("save")

        def poll(self):
            raise RuntimeError("the save failed")

        def close(self):
            events.append("saves finished")

    class Reporter:
        pending = None

        def restart_clock(self):
            pass

        def dispatched(self, step, metrics):
            pass

        def flush(self):
            pass

    class Preemption:
        def reached(self, step):
            return False

    class HeldOut(loop.Hook):
        def due(self, at):
            return True

        def run(self, at, state):
            raise rewards.RewardError("the held-out reward raised")

    def failing_step(state, batch):
        raise rewards.RewardError("the reward raised")

    def step(state, batch):
        return state, {}

    config = types.SimpleNamespace(checkpoint_period=1)
    for step_fn, hooks, error in [(failing_step, [], "the reward raised"),
                                  (step, [HeldOut()], "the held-out reward raised")]:
        events.clear()
        checkpoint = loop.Checkpoint(config, Checkpointer(), None, {})
        with pytest.raises(rewards.RewardError, match=error):
            loop.train(step_fn, {}, iter([{}] * 3), 0, 3, [checkpoint, *hooks], Reporter(), Preemption(), events.append)
        assert events == (["saves finished"] if step_fn is failing_step else ["save", "saves finished"])
    events.clear()
    with pytest.raises(RuntimeError, match="the save failed"):
        loop.train(step, {}, iter([{}] * 3), 0, 3, [loop.Checkpoint(types.SimpleNamespace(checkpoint_period=2),
                                                                    Checkpointer(), None, {})],
                   Reporter(), Preemption(), events.append)
    assert events == []


def test_builtin_rewards():
    assert rewards.exact_match([""] * 3, ["42", " <think>4+2</think><answer>6</answer>", "7"], ["42", "6", "8"]) == [1, 1, 0]
    assert rewards.format_reward([""] * 2, ["<think>a</think> <answer>b</answer>", "b"], ["", ""]) == [1.0, 0.0]
    assert set(rewards.BUILTIN) == set(config_lib.objectives.GRPO_REWARDS)


def test_completions_stop_at_eos_and_the_templates_end_of_turn(dataset):
    from maxtrain.data import chat, prompts  # pylint: disable=import-outside-toplevel
    from maxtrain.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

    tok = tokenizer_lib.load(dataset["tokenizer"])
    stops = prompts.stop_ids(chat.template_for(tok, "chatml"))
    assert [tok.piece(i) for i in stops] == [tok.piece(tok.eos_id), "<|im_end|>"]  # not the bare "▁" before it

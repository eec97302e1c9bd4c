"""GRPO's multi-turn episodes with an environment (training/environments.py, episodes.py, calculator.py): the
calculator, the rows episodes make (the environment's tokens masked out of the loss), the turn and token budgets,
the sampler's log-probabilities against the training pass on multi-turn rows, a real run, and bad environments."""

import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain import config as config_lib
from maxtrain import train
from maxtrain.config import objectives
from maxtrain.data import chat, prompts as prompts_lib
from maxtrain.models import sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import calculator, environments, episodes, grpo, losses
from post_helpers import compose, grpo_args, make_dataset

BAD = environments.BadEnvironment


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo_env")
    paths = make_dataset(str(directory), n=64)
    paths["dir"] = str(directory)
    return paths


def _config(dataset, tmp_path, *extra):
    return config_lib.with_devices(config_lib.load_config(compose(
        BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
        "ici_fsdp_parallelism=1", *extra)), 1)


def _prompts(config):
    return prompts_lib.make_inputs(config, 1, log=lambda *a: None)


# --------------------------------------------------------------------------------------------
# The calculator


@pytest.mark.parametrize("expression, value", [("12+34", "46"), (" (3-5)*2 ", "-4"), ("7/2", "3.5"), ("2**10", "1024"),
                                               ("-3+1.5", "-1.5"), ("8//3", "2")])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator.evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "only numbers"), ("abs(-1)", "only numbers"), ("1/0", "division by zero"),
    ("9**99", "an exponent beyond 64"), ("10**13", "a number beyond"), ("1+", "not an arithmetic expression"),
    ("", "1 to 200 characters"), ("'a'*3", "only numbers")])
def test_the_calculator_refuses_what_is_not_arithmetic(expression, why):
    with pytest.raises(calculator.NotEvaluated, match=why):
        calculator.evaluate(expression)


def test_a_calculator_episode_calls_the_tool_then_answers():
    env = calculator.Calculator()
    assert env.reset({"prompt": "3+4=", "answer": "7"}) is None
    assert env.step("<tool>3+4</tool>") == ("<result>7</result>", 0.0, False)
    assert env.step("<tool>3+</tool>") == ("<result>error</result>", 0.0, False)
    assert env.step("<answer>7</answer>") == ("", 1.0, True)
    assert env.step("8") == ("", 0.0, True)
    assert objectives.GRPO_ENVIRONMENTS == tuple(environments.BUILTIN)  # the config's list is the built-ins'


# --------------------------------------------------------------------------------------------
# Episodes -> rows: a scripted policy (it calls the calculator on its prompt's sum, then answers)


class Scripted:
    """A policy written out: on a context without a <result>, "<tool>a+b</tool>"; after one, the result (or
    `answer` when given); each turn ends with the template's end of turn. Log-probability -0.25 per token."""

    def __init__(self, tokenizer, budget, answer=None, end="<|im_end|>"):
        self.tok, self.budget, self.answer, self.end = tokenizer, budget, answer, end

    def __call__(self, params, ids, first, key):
        del params, key
        tokens = np.zeros((ids.shape[0], self.budget), np.int32)
        for i, (row, f) in enumerate(zip(ids, first)):
            context = self.tok.decode([int(t) for t in row[f:]])
            a, b = re.search(r"(\d+)\+(\d+)=", context).groups()
            result = re.findall(r"<result>(.*?)</result>", context)
            said = (f"<tool>{a}+{b}</tool>" if not result else self.answer or result[-1]) + self.end
            turn = self.tok.encode(said)[:self.budget]
            tokens[i, :len(turn)] = turn
        return tokens, np.full(tokens.shape, -0.25, np.float32)


def test_episode_rows_hold_the_conversation_as_sft_renders_it_with_the_environment_masked_out(dataset, tmp_path):
    config = _config(dataset, tmp_path, "grpo_environment=calculator", "max_target_length=96")
    prompts = _prompts(config)
    record = prompts.first_records[0]
    a, b = re.search(r"(\d+)\+(\d+)=", record.text).groups()
    ids, first = grpo.left_padded([record], config.max_prefill_predict_length)
    source = environments.load("calculator")
    played = episodes.Episodes(config, prompts, source).play(
        Scripted(prompts.tokenizer, episodes.budget(config)), None, ids, first, [record.text], [record.answer],
        jax.random.key(0))
    assert played.turns.tolist() == [2] and played.done.tolist() == [True] and played.reward.tolist() == [1.0]
    assert played.final == [str(int(a) + int(b))]
    # the row is the transcript as SFT's data renders it (chat.parts), up to the last turn's end-of-turn token
    transcript = [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"<tool>{a}+{b}</tool>"},
                  {"role": "tool", "content": f"<result>{int(a) + int(b)}</result>"},
                  {"role": "assistant", "content": str(int(a) + int(b))}]
    want, want_weights = chat.encode_parts(prompts.template, chat.parts(prompts.template, transcript, True))
    n = played.kept[0]
    row = np.concatenate([played.prompt_ids[0], played.tokens[0, :n]])
    np.testing.assert_array_equal(row, want[:len(row)])
    assert len(want) - len(row) == 1  # only the "\n" the template writes after the last reply's <|im_end|>
    # loss weight 1 on the model's tokens, 0 on the calculator's: SFT's assistant weights but for the "\n" the
    # template writes after the tool call's <|im_end|> (SFT's reply part holds it; here the model did not sample it)
    p = len(played.prompt_ids[0])
    differ = np.flatnonzero(played.model[0, :n] != want_weights[p:p + n])
    assert differ.size == 1 and want_weights[p + differ[0]] == 1 and played.tokens[0, differ[0]] == want[p + differ[0]]
    assert prompts.tokenizer.decode([int(played.tokens[0, differ[0]])]) == "\n"
    assert 0 < played.model[0, :n].sum() < n and (played.model[0, n:] == 0).all()
    update = grpo.assemble(played.prompt_ids, played.tokens, played.log_probs, played.kept, np.ones(1, np.float32),
                           config.max_target_length, (1, 1), model=played.model)
    w, old = update["loss_weights"][0, 0], update["old_log_probs"][0, 0]
    np.testing.assert_array_equal(w[p - 1:p - 1 + n], played.model[0, :n])
    assert w.sum() == played.model.sum() and (old[w == 0] == 0).all() and (old[w > 0] == -0.25).all()
    observation = played.tokens[0, :n][played.model[0, :n] == 0]
    assert prompts.tokenizer.decode(observation.tolist()).strip().startswith("<|im_start|>tool")


def test_the_turn_budget_ends_an_episode_and_its_last_turn_is_scored(dataset, tmp_path):
    """grpo_max_turns=1: the tool call is the only turn; step scores it (0) and its observation is dropped."""
    config = _config(dataset, tmp_path, "grpo_environment=calculator", "max_target_length=96", "grpo_max_turns=1")
    prompts = _prompts(config)
    record = prompts.first_records[0]
    ids, first = grpo.left_padded([record], config.max_prefill_predict_length)
    played = episodes.Episodes(config, prompts, environments.load("calculator")).play(
        Scripted(prompts.tokenizer, episodes.budget(config)), None, ids, first, [record.text], [record.answer],
        jax.random.key(0))
    assert played.turns.tolist() == [1] and played.done.tolist() == [False] and played.reward.tolist() == [0.0]
    assert played.final[0].startswith("<tool>") and (played.model[0, :played.kept[0]] == 1).all()


class Echo:
    """Never done: each turn's observation is `text`, reward 0.5."""
    text = "ok"

    def reset(self, record):
        return None

    def step(self, message):
        return self.text, 0.5, False


def test_the_token_budget_bounds_every_episode(dataset, tmp_path):
    """No turn limit: the episode runs until an observation leaves no room (it is dropped) or a turn runs to
    the budget; every episode's tokens fit max_target_length - max_prefill_predict_length."""
    config = _config(dataset, tmp_path, "grpo_environment=calculator", "max_target_length=96")
    prompts = _prompts(config)
    record = prompts.first_records[0]
    budget = episodes.Episodes(config, prompts, environments.Source("t:Echo", Echo))
    e = episodes.budget(config)
    ids, first = grpo.left_padded([record], config.max_prefill_predict_length)
    played = budget.play(Scripted(prompts.tokenizer, e, answer="1"), None, ids, first, [record.text],
                         [record.answer], jax.random.key(0))
    assert played.kept[0] <= e and played.turns[0] >= 2 and not played.done[0]
    assert played.reward[0] == 0.5 * played.turns[0]
    # the last turn ran to the budget without its stop token, or another observation would leave no room
    obs = budget.renderer.observation(Echo.text, prompts.stop_ids[-1])
    last = played.tokens[0, played.kept[0] - 1]
    assert last not in prompts.stop_ids or played.kept[0] + len(obs) >= e
    # an observation longer than the whole budget is the environment's mistake
    Long = type("Long", (Echo,), {"text": "9" * (4 * e)})
    with pytest.raises(BAD, match=r"grpo_environment: 't:Long' step returned an observation of \d+ tokens .* more than "
                                  rf"an episode's whole budget of {e} tokens \(max_target_length - "
                                  r"max_prefill_predict_length\); make the environment's observations shorter"):
        episodes.Episodes(config, prompts, environments.Source("t:Long", Long)).play(
            Scripted(prompts.tokenizer, e), None, ids, first, [record.text], [record.answer], jax.random.key(0))


# --------------------------------------------------------------------------------------------
# A real tiny model's episodes: turns, masks, and the sampler's log-probabilities on multi-turn rows


def _stopping_params(config, stop: int):
    """A random tiny model that ends its turn after a few tokens: one embedding dimension constant, read by the
    output column of the stop token."""
    params = Model.bind(config).init_params(jax.random.key(1))
    params["token_embedding"] = params["token_embedding"].at[:, 0].set(4.0)
    params["output"] = params["output"].at[0, :].set(0.0).at[0, stop].set(1.5)
    return params


@pytest.mark.parametrize("max_turns", slow_params([3, -1], {"-1"}))
def test_a_real_models_episodes_mask_the_environment_and_keep_the_samplers_log_probs(dataset, tmp_path, max_turns):
    config = _config(dataset, tmp_path, "grpo_environment=calculator", "max_target_length=64",
                     f"grpo_max_turns={max_turns}", "decode_sampling_temperature=1.0")
    prompts = _prompts(config)
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    params = _stopping_params(config, prompts.stop_ids[-1])
    e = episodes.budget(config)
    sample = jax.jit(lambda p, ids, first, key: sampling.sample_completions(
        p, ids, first, key, model=model, rt=rt, max_new_tokens=e, **sampling.sampling_settings(config)))
    records = (prompts.first_records * 4)[:4]
    ids, first = grpo.left_padded(records, config.max_prefill_predict_length)
    played = episodes.Episodes(config, prompts, environments.Source("t:Echo", Echo)).play(
        sample, params, ids, first, [r.text for r in records], [r.answer for r in records], jax.random.key(5))
    assert (played.kept <= e).all() and (played.turns >= 1).all() and not played.done.any()
    if max_turns > 0:
        assert played.turns.max() == max_turns  # the stopping model uses its turns
    else:
        assert played.turns.max() >= 2
    assert played.reward.tolist() == (0.5 * played.turns).tolist()
    update = grpo.assemble(played.prompt_ids, played.tokens, played.log_probs, played.kept,
                           np.linspace(-1, 1, 4).astype(np.float32), config.max_target_length, (1, 4), model=played.model)
    batch = {k: jnp.asarray(v[0]) for k, v in update.items()}
    w = np.asarray(batch["loss_weights"])
    assert w.sum() == played.model.sum() < played.kept.sum()  # observations are in the rows, weight 0
    recomputed, _ = losses.target_log_probs(params, batch, model, rt, 1.0)
    np.testing.assert_allclose(np.asarray(recomputed)[w > 0], np.asarray(batch["old_log_probs"])[w > 0], atol=1e-5)
    assert (np.asarray(batch["old_log_probs"])[w == 0] == 0).all()
    # the loss ignores the observations: changing their old log-probs and advantages changes nothing
    changed = dict(batch, old_log_probs=jnp.where(w == 0, -3.0, batch["old_log_probs"]),
                   advantages=jnp.where(w == 0, 7.0, batch["advantages"]))
    same = [losses.grpo(params, b, params, model, rt)[:2] for b in (batch, changed)]
    assert float(same[0][0]) == float(same[1][0]) and float(same[0][1]) == float(same[1][1]) == w.sum()


@pytest.mark.slow
def test_grpo_with_the_calculator_trains_and_evaluates(dataset, tmp_path):
    """A real step of train.main with grpo_environment=calculator: the multi-turn rollout, its update and
    the held-out episodes."""
    out = train.main(compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
                             "run_name=calc", "steps=1", "grpo_environment=calculator", "grpo_max_turns=2",
                             "max_target_length=32", "grpo_reward_functions=[]", f"metrics_file={tmp_path}/m.jsonl"))
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    step = next(m for m in lines if "learning/loss" in m)
    assert math.isfinite(step["learning/loss"]) and 1 <= step["learning/grpo_turns"] <= 2
    assert 0 <= step["learning/grpo_model_token_fraction"] <= 1
    assert any("eval/grpo_multi_turn_fraction" in m for m in lines)
    assert out.state is not None


# --------------------------------------------------------------------------------------------
# Bad environments: one line naming the environment and the fix


class RaisesInStep:
    def reset(self, record):
        return None

    def step(self, message):
        return {}["missing"]


class RaisesInReset:
    def reset(self, record):
        raise ValueError("no such level")

    def step(self, message):
        return "", 0.0, True


def _returns(value):
    return type("Returns", (), {"reset": lambda self, record: None, "step": lambda self, message: value})


def _resets_to(value):
    return type("Resets", (), {"reset": lambda self, record: value, "step": lambda self, message: ("", 0.0, True)})


@pytest.mark.parametrize("factory, call, match", [
    (RaisesInStep, "step", r"grpo_environment: 't:E' step on the message 'hi' raised KeyError: 'missing' at "
                           r".*test_grpo_environments.py:\d+ in step at step 3\. Fix the environment \(maxtrain calls "
                           r"reset\(record\) -> None \| str \| list of messages, then step\(message\) ->"),
    (RaisesInReset, "reset", r"grpo_environment: 't:E' reset on the record \{'prompt': '1\+1=', 'answer': '2'\} raised "
                             r"ValueError: no such level at .*test_grpo_environments.py:\d+ in reset at step 3"),
    (_returns(["ok", 1.0, True]), "step", r"step returned \['ok', 1.0, True\] \(a list\) for the message 'hi' at "
                                          r"step 3; it must return a tuple \(observation: str, reward: float, done: "
                                          r"bool\)"),
    (_returns(("ok", "1", True)), "step", r"step returned \('ok' \(a str\), '1' \(a str\), True \(a bool\)\)"),
    (_returns(("ok", 1.0, 1)), "step", r"step returned \('ok' \(a str\), 1.0 \(a float\), 1 \(a int\)\)"),
    (_returns((None, 1.0, False)), "step", r"step returned \(None \(a NoneType\)"),
    (_returns(("ok", float("nan"), True)), "step", r"step returned the reward nan .*; rewards must be finite"),
    (_resets_to({"role": "user"}), "reset", r"reset returned \{'role': 'user'\} \(a dict\) at step 3; it must return "
                                            r"None \(the record's prompt\), a string"),
    (_resets_to([]), "reset", r"reset returned \[\] \(a list\)"),
])
def test_an_environment_that_raises_or_breaks_the_contract_is_named_with_the_fix(factory, call, match):
    source = environments.Source("t:E", factory)
    env = environments.new(source)
    with pytest.raises(BAD, match=match):
        if call == "reset":
            environments.reset(source, env, {"prompt": "1+1=", "answer": "2"}, " at step 3")
        else:
            environments.step(source, env, "hi", " at step 3")


def test_environments_that_cannot_be_loaded_or_made_are_named(tmp_path, monkeypatch):
    (tmp_path / "grpo_bad_envs.py").write_text(
        "class NoStep:\n    def reset(self, record):\n        return None\n\n\n"
        "class NeedsArguments:\n    def __init__(self, level):\n        pass\n\n"
        "    def reset(self, record):\n        return None\n\n    def step(self, message):\n        return '', 0.0, True\n")
    (tmp_path / "grpo_broken_envs.py").write_text("import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BAD, match=r"'no_such_module_xyz:Env': module 'no_such_module_xyz' cannot be imported "
                                  r"\(ModuleNotFoundError: .*\); put it on PYTHONPATH or fix it"):
        environments.load("no_such_module_xyz:Env")
    with pytest.raises(BAD, match=r"'grpo_broken_envs:Env': module 'grpo_broken_envs' cannot be imported"):
        environments.load("grpo_broken_envs:Env")
    with pytest.raises(BAD, match=r"module 'grpo_bad_envs' has no class 'Missing'"):
        environments.load("grpo_bad_envs:Missing")
    with pytest.raises(BAD, match=r"'grpo_bad_envs:NoStep' has no method step; an environment defines reset\(record\)"):
        environments.load("grpo_bad_envs:NoStep")
    source = environments.load("grpo_bad_envs:NeedsArguments")
    with pytest.raises(BAD, match=r"'grpo_bad_envs:NeedsArguments' \(making an instance with no arguments\) raised "
                                  r"TypeError: .*level"):
        environments.new(source)
    with pytest.raises(BAD, match=r"grpo_environment: 'maze' is neither a built-in environment \(calculator\) nor an "
                                  r"import path module:Class"):
        environments.load("maze")
    for name in ("grpo_bad_envs", "grpo_broken_envs"):
        sys.modules.pop(name, None)


def test_a_reset_prompt_beyond_the_prompt_budget_is_the_environments_mistake(dataset, tmp_path):
    config = _config(dataset, tmp_path, "grpo_environment=calculator")
    prompts = _prompts(config)
    long = _resets_to("1+1=" * 40)
    with pytest.raises(BAD, match=r"grpo_environment: 't:Long' reset returned a prompt of \d+ tokens at step 2, more "
                                  r"than max_prefill_predict_length=16; return a shorter one"):
        episodes.Episodes(config, prompts, environments.Source("t:Long", long)).start(["x"], ["2"], " at step 2")


def test_a_bad_environment_stops_train_before_compiling(dataset, tmp_path, monkeypatch):
    (tmp_path / "grpo_env_raises.py").write_text(
        "class Env:\n    def reset(self, record):\n        return None\n\n"
        "    def step(self, message):\n        raise RuntimeError('the grid is gone')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BAD, match=r"grpo_environment: 'grpo_env_raises:Env' step on the message .* raised RuntimeError: "
                                  r"the grid is gone at .*grpo_env_raises.py:6 in step \(the first record of a "
                                  r"training file, before compiling\)"):
        train.main(compose(BASE_YML, *TINY, *grpo_args(dataset, dataset["dir"]), f"base_output_directory={tmp_path}",
                           "run_name=bad", "steps=1", "grpo_environment=grpo_env_raises:Env"))
    sys.modules.pop("grpo_env_raises", None)

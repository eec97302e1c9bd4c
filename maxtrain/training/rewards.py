"""GRPO's verifiable rewards: functions of the completions -> one number per completion.

grpo_reward_functions names them; a completion's reward is their sum.

    exact_match      1 when the completion's answer equals the row's answer, else 0. The completion's
                     answer is the text of its last <answer>...</answer> when it has one, else the
                     whole completion; both sides are compared without surrounding white space.
    format           1 when the completion is <think>...</think> followed by <answer>...</answer>
                     (DeepSeek-R1's format, white space around them allowed), else 0.
    module:function  your function, imported by path (its module on PYTHONPATH), called as
                     fn(prompts=[...], completions=[...], answers=[...]): lists of strings of equal
                     length, one entry per completion (a prompt repeats for its num_generations
                     completions), completions cut before their stop token. It returns that many
                     finite numbers (a list, tuple or 1-d array).

Every function is imported and called once on the first prompt of every training file (with its
answer as the completion) before any work, so a name that does not import or a function that
returns the wrong shape stops the run at once.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

import numpy as np

from maxtrain.errors import UserError

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


class RewardError(UserError):
    """A reward function that cannot be imported or returns something else than one number per completion."""


def completion_answer(completion: str) -> str:
    found = ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def exact_match(prompts, completions, answers):
    del prompts
    return [float(completion_answer(c) == a.strip()) for c, a in zip(completions, answers)]


def format_reward(prompts, completions, answers):
    del prompts, answers
    return [float(FORMAT.fullmatch(c) is not None) for c in completions]


BUILTIN = {"exact_match": exact_match, "format": format_reward}


def load_one(name: str) -> Callable:
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise RewardError(f"grpo_reward_functions: {name!r} is neither a built-in reward ({', '.join(BUILTIN)}) nor "
                          "an import path module:function (e.g. my_rewards:score, with my_rewards.py on PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any failure of the user's module: ImportError, SyntaxError, its own errors
        raise RewardError(f"grpo_reward_functions: {name!r}: module {module_name!r} cannot be imported "
                          f"({type(e).__name__}: {e}); put it on PYTHONPATH or fix it") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"grpo_reward_functions: {name!r}: module {module_name!r} has no function {attr!r}"
                          f"{'' if fn is None else f' ({attr} is a {type(fn).__name__})'}")
    return fn


def load(names) -> dict[str, Callable]:
    """{name: function} for grpo_reward_functions, each imported now."""
    return {name: load_one(name) for name in names}


def score(functions: dict, prompts: list[str], completions: list[str], answers: list[str]) -> tuple[np.ndarray, dict]:
    """(the summed reward float32 [N], {name: that function's rewards [N]}) for N completions."""
    n = len(completions)
    parts = {}
    for name, fn in functions.items():
        values = fn(prompts=prompts, completions=completions, answers=answers)
        try:
            array = np.asarray(values, np.float64)
        except (TypeError, ValueError):
            array = None
        if array is None or array.shape != (n,):
            got = type(values).__name__ if array is None else f"shape {array.shape}"
            raise RewardError(f"grpo_reward_functions: {name!r} returned {got} for {n} completions; it must return "
                              f"{n} numbers, one per completion")
        if not np.isfinite(array).all():
            raise RewardError(f"grpo_reward_functions: {name!r} returned a non-finite reward "
                              f"({array[~np.isfinite(array)][0]}); rewards must be finite numbers")
        parts[name] = array.astype(np.float32)
    total = sum(parts.values()) if parts else np.zeros(n, np.float32)
    return np.asarray(total, np.float32), parts


def check(functions: dict, prompts: list[str], answers: list[str]) -> None:
    """Calls every function once on (prompt, its answer as the completion) pairs: a wrong shape fails now."""
    score(functions, list(prompts), list(answers), list(answers))

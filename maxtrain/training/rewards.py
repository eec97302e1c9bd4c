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

Every function is imported and its signature checked before any work (a function written for TRL's
GRPOTrainer, f(completions, answer, **kwargs), is named as such), then called before compiling on
made-up completions of the first prompt of every training file (its answer bare and in R1's format,
a wrong answer, an empty completion: distinct, so that one number for the whole batch, a list of
the wrong length, None, NaN or text is refused). A function that raises, then or during training,
stops the run with one line naming it, its exception, the line of its file that raised and the
first completion that makes it raise alone; the checkpoints saved so far are kept.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import time
import traceback
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


CALL = "fn(prompts=[...], completions=[...], answers=[...])"
EXPECTED = "def score(prompts, completions, answers, **kwargs)"
# Parameters of TRL's reward functions (dataset columns and trainer extras passed as keyword arguments).
TRL_PARAMETERS = ("answer", "solution", "ground_truth", "completion_ids", "trainer_state", "prompt", "completion")
LOCATE_SECONDS = 10.0  # a reward that raised is called on one completion at a time for at most this long


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: its first call tells
        return None


def _written_for_trl(fn: Callable) -> bool:
    """Whether `fn`'s parameters look like TRL's convention: dataset columns (answer, solution) or **kwargs
    instead of maxtrain's answers."""
    signature = _signature(fn)
    if signature is None:
        return False
    names = signature.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values())
    return any(n in names for n in TRL_PARAMETERS) or (takes_kwargs and "answers" not in names)


def _trl_hint(fn: Callable) -> str:
    return (" It looks written for TRL's GRPOTrainer, which passes the dataset's columns as keyword arguments "
            f"(answer=[...]); maxtrain calls {CALL}: define it as {EXPECTED}." if _written_for_trl(fn) else "")


def check_signature(name: str, fn: Callable) -> None:
    """RewardError unless `fn` can be called as maxtrain calls it (keywords prompts, completions, answers)."""
    signature = _signature(fn)
    if signature is None:
        return
    try:
        signature.bind(prompts=[], completions=[], answers=[])
    except TypeError as error:
        raise RewardError(f"grpo_reward_functions: {name!r} is {getattr(fn, '__name__', 'a function')}{signature}, "
                          f"which maxtrain cannot call as {CALL} ({error}).{_trl_hint(fn)}"
                          + ("" if _written_for_trl(fn) else f" Define it as {EXPECTED}.")) from None


def import_named(key: str, name: str, builtin: dict, kind: str, example: str, error: type):
    """What setting `key`'s value `name` names: a built-in (`builtin[name]`), or module:attr imported now (a reward
    function here, an environment class in training/environments.py). `error` is raised, one line naming the value
    and the fix, for a name of neither form, a module that cannot be imported, or an attribute it lacks or that
    cannot be called; `kind` is "function" or "class", `example` a module:attr with its module file."""
    if name in builtin:
        return builtin[name]
    module_name, _, attr = name.partition(":")
    noun = "reward" if kind == "function" else "environment"
    if not module_name or not attr:
        raise error(f"{key}: {name!r} is neither a built-in {noun} ({', '.join(builtin)}) nor an import path "
                    f"module:{'function' if kind == 'function' else 'Class'} (e.g. {example} on PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any failure of the user's module: ImportError, SyntaxError, its own errors
        raise error(f"{key}: {name!r}: module {module_name!r} cannot be imported ({type(e).__name__}: {e}); put it "
                    "on PYTHONPATH or fix it") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise error(f"{key}: {name!r}: module {module_name!r} has no {kind} {attr!r}"
                    f"{'' if found is None else f' ({attr} is a {type(found).__name__})'}")
    return found


def load_one(name: str) -> Callable:
    fn = import_named("grpo_reward_functions", name, BUILTIN, "function", "my_rewards:score, with my_rewards.py",
                      RewardError)
    if name not in BUILTIN:
        check_signature(name, fn)
    return fn


def load(names) -> dict[str, Callable]:
    """{name: function} for grpo_reward_functions, each imported now and its signature checked."""
    return {name: load_one(name) for name in names}


def _short(value, width: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _returned(values, array, n: int) -> str:
    """What a reward function returned instead of n numbers, in words."""
    if values is None:
        return "None"
    if array is not None and array.dtype.kind in "biuf":
        if array.ndim == 0:
            return f"one number ({_short(values)})"
        if array.ndim == 1:
            return f"{array.shape[0]} number{'' if array.shape[0] == 1 else 's'}"
        return f"an array of shape {list(array.shape)}"
    kinds = sorted({type(v).__name__ for v in values}) if isinstance(values, (list, tuple)) else []
    return f"{_short(values)} (a {type(values).__name__}{' of ' + ', '.join(kinds) if kinds else ''})"


def _as_rewards(name: str, values, n: int, context: str) -> np.ndarray:
    """float32 [n] of what `name` returned; a RewardError naming it unless that is n finite numbers."""
    try:
        array = None if values is None or isinstance(values, (str, bytes, dict)) else np.asarray(values)
    except (TypeError, ValueError):  # ragged lists
        array = None
    if array is None or array.shape != (n,) or array.dtype.kind not in "biuf":
        raise RewardError(f"grpo_reward_functions: {name!r} returned {_returned(values, array, n)} for {n} "
                          f"completions{context}; it must return {n} numbers, one per completion (a list, tuple or "
                          "1-d array)")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        bad = int(np.flatnonzero(~np.isfinite(array))[0])
        raise RewardError(f"grpo_reward_functions: {name!r} returned a non-finite reward ({array[bad]}) for "
                          f"completion {bad} of {n}{context}; rewards must be finite numbers")
    return array.astype(np.float32)


def _first_failing(fn: Callable, prompts: list, completions: list, answers: list) -> tuple[int | None, int]:
    """(the first completion that alone makes `fn` raise or None, how many were tried): one at a time, for at
    most LOCATE_SECONDS."""
    deadline = time.monotonic() + LOCATE_SECONDS
    for i in range(len(completions)):
        if time.monotonic() > deadline:
            return None, i
        try:
            fn(prompts=[prompts[i]], completions=[completions[i]], answers=[answers[i]])
        except Exception:  # pylint: disable=broad-except  (whatever the user's function raises)
            return i, i + 1
    return None, len(completions)


def _raised(name: str, fn: Callable, error: Exception, prompts: list, completions: list, answers: list,
            context: str) -> str:
    """One line: the reward, its exception, the line of the user's file that raised, the completion."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # without score's own frame
    source = inspect.getsourcefile(fn) if inspect.isfunction(fn) else None
    own = [f for f in frames if source and os.path.abspath(f.filename) == os.path.abspath(source)]
    frame = (own or frames or [None])[-1]
    where = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
    message = " ".join(str(error).split())
    found, tried = _first_failing(fn, prompts, completions, answers)
    n = len(completions)
    which = (f" on completion {found} of {n} ({_short(completions[found])})" if found is not None else
             f" on a batch of {n} completions ({'none' if tried == n else f'none of the first {tried}'} raises alone)")
    hint = _trl_hint(fn) if isinstance(error, (KeyError, TypeError)) else ""
    return (f"grpo_reward_functions: {name!r} raised {type(error).__name__}"
            f"{': ' + message[:200] if message else ''}{where}{which}{context}."
            + (hint or f" Fix the function (maxtrain calls it as {CALL}, one entry per completion)"))


def score(functions: dict, prompts: list[str], completions: list[str], answers: list[str],
          context: str = "") -> tuple[np.ndarray, dict]:
    """(the summed reward float32 [N], {name: that function's rewards [N]}) for N completions. A function that
    raises or returns anything but N finite numbers is a RewardError naming it; `context` (" at step 7")
    follows the problem in its message."""
    n = len(completions)
    parts = {}
    for name, fn in functions.items():
        try:
            values = fn(prompts=prompts, completions=completions, answers=answers)
        except Exception as error:  # pylint: disable=broad-except  (whatever the user's function raises)
            raise RewardError(_raised(name, fn, error, prompts, completions, answers, context)) from error
        parts[name] = _as_rewards(name, values, n, context)
    total = sum(parts.values()) if parts else np.zeros(n, np.float32)
    return np.asarray(total, np.float32), parts


def made_up_completions(answer: str) -> list[str]:
    """Distinct completions of a prompt for the check before compiling: its answer bare and in DeepSeek-R1's
    format, a wrong answer in that format, an empty completion."""
    made_up = [answer, f"<think>made up</think> <answer>{answer}</answer>",
               f"<think>made up</think> <answer>not {answer}</answer>", "", "a made-up completion"]
    return list(dict.fromkeys(made_up))[:4]


def check(functions: dict, prompts: list[str], answers: list[str]) -> None:
    """Calls every function once, before compiling, on made-up completions of each (prompt, answer): distinct
    completions, at least 4, so that a function returning one number for the batch is refused now."""
    batch = [(p, c, a) for p, a in zip(prompts, answers) for c in made_up_completions(a)]
    score(functions, [p for p, _, _ in batch], [c for _, c, _ in batch], [a for _, _, a in batch],
          context=" (made-up completions of the first prompt of each training file, before compiling)")

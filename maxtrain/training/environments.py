"""GRPO's environments: the contract a multi-turn environment keeps, and the calls that check it.

    grpo_environment=calculator             the built-in example (training/calculator.py)
    grpo_environment=my_envs:Maze           your class, imported by path (its module on PYTHONPATH)

The contract (`Environment`). maxtrain makes one instance per episode, `factory()` with no arguments
(episodes never share state), then calls

    reset(record)    record = {"prompt": the prompt rendered with the chat template, "answer": the row's
                     answer}. Returns None (the episode starts from the record's prompt), or the first
                     observation: a string (the user's message) or a list of messages ({"role", "content"}),
                     rendered with the chat template and its generation prompt in place of the record's.
    step(message)    message = the model's turn as text, cut before its stop token. Returns
                     (observation: str, reward: a finite number, done: bool). The observation is shown to
                     the model as a "tool" message before its next turn (ignored when done).

training/episodes.py plays the episodes: how turns, observations, budgets and rewards make one row.

Mistakes stop the run with one line naming the environment and the fix (`BadEnvironment`): a name
that is neither built in nor module:Class, a module that cannot be imported, a class without reset or
step, a reset or step that raises (with the line of the environment's file that raised, as
rewards.py names a reward function's) or returns something else than the contract says. They are
called before compiling on the first record of every training file (`check` in episodes.py), so most
mistakes stop the run before any work.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import traceback
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from maxtrain.errors import UserError
from maxtrain.training import calculator, rewards

BUILTIN = {"calculator": calculator.Calculator}
CONTRACT = ("reset(record) -> None | str | list of messages, then step(message) -> (observation: str, reward: "
            "float, done: bool)")


@runtime_checkable
class Environment(Protocol):
    """What an environment is to maxtrain (the module's docstring); one instance per episode."""

    def reset(self, record: dict) -> None | str | list[dict]:
        ...

    def step(self, message: str) -> tuple[str, float, bool]:
        ...


class BadEnvironment(UserError):
    """An environment that cannot be loaded, raises, or answers other than the contract says."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A loaded environment: its name as configured and the factory that makes one per episode."""
    name: str
    factory: Callable[[], Any]

    def where(self) -> str:
        return f"grpo_environment: {self.name!r}"


def load(name: str) -> Source:
    """The environment grpo_environment names, imported now; its reset and step are checked to be methods."""
    if name in BUILTIN:
        return Source(name, BUILTIN[name])
    factory = rewards.import_named("grpo_environment", name, BUILTIN, "class", "my_envs:Maze, with my_envs.py",
                                   BadEnvironment)
    if inspect.isclass(factory):
        missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            raise BadEnvironment(f"grpo_environment: {name!r} has no method {' or '.join(missing)}; an environment "
                                    f"defines {CONTRACT} (maxtrain/training/environments.py)")
    return Source(name, factory)


def short(value, width: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _located(source: Source, error: Exception) -> str:
    """' at file:line in function' of the frame that raised, preferring the environment's own file."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # without the caller's own frame
    try:
        own_file = inspect.getsourcefile(source.factory)
    except TypeError:  # a builtin or C callable
        own_file = None
    own = [f for f in frames if own_file and os.path.abspath(f.filename) == os.path.abspath(own_file)]
    frame = (own or frames or [None])[-1]
    return f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""


def _raised(source: Source, what: str, error: Exception, context: str) -> BadEnvironment:
    message = " ".join(str(error).split())
    return BadEnvironment(f"{source.where()} {what} raised {type(error).__name__}"
                             f"{': ' + message[:200] if message else ''}{_located(source, error)}{context}. Fix the "
                             f"environment (maxtrain calls {CONTRACT})")


def new(source: Source, context: str = ""):
    """One episode's environment: factory()."""
    try:
        env = source.factory()
    except Exception as error:  # pylint: disable=broad-except  (whatever the user's class raises)
        raise _raised(source, "(making an instance with no arguments)", error, context) from error
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise BadEnvironment(f"{source.where()} made a {type(env).__name__} without {' or '.join(missing)}; an "
                                f"environment defines {CONTRACT}")
    return env


def reset(source: Source, env, record: dict, context: str = "") -> list[dict] | None:
    """None (the record's prompt) or the first messages that env.reset(record) returned."""
    try:
        out = env.reset(record)
    except Exception as error:  # pylint: disable=broad-except
        raise _raised(source, f"reset on the record {short(record)}", error, context) from error
    if out is None:
        return None
    if isinstance(out, str):
        return [{"role": "user", "content": out}]
    if isinstance(out, list) and out and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in out):
        return out
    raise BadEnvironment(f"{source.where()} reset returned {short(out)} (a {type(out).__name__}){context}; it must "
                            "return None (the record's prompt), a string (the first user message) or a non-empty "
                            "list of messages {'role': ..., 'content': ...}")


def step(source: Source, env, message: str, context: str = "") -> tuple[str, float, bool]:
    """(observation, reward, done) that env.step(message) returned, checked against the contract."""
    try:
        out = env.step(message)
    except Exception as error:  # pylint: disable=broad-except
        raise _raised(source, f"step on the message {short(message)}", error, context) from error
    ok = isinstance(out, tuple) and len(out) == 3
    observation, reward, done = out if ok else (None, None, None)
    number = isinstance(reward, numbers.Real) and not isinstance(reward, (bool, np.bool_))
    if not (ok and isinstance(observation, str) and number and isinstance(done, (bool, np.bool_))):
        got = (f"({', '.join(f'{short(v, 30)} (a {type(v).__name__})' for v in out)})" if ok
               else f"{short(out)} (a {type(out).__name__})")
        raise BadEnvironment(f"{source.where()} step returned {got} for the message {short(message)}{context}; "
                                "it must return a tuple (observation: str, reward: float, done: bool)")
    if not math.isfinite(float(reward)):
        raise BadEnvironment(f"{source.where()} step returned the reward {reward} for the message "
                                f"{short(message)}{context}; rewards must be finite numbers")
    return observation, float(reward), bool(done)

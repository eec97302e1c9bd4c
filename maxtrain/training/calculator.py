"""A tool-calling example environment: a calculator the model may call inside <tool>..</tool>.

    grpo_environment=calculator     (or maxtrain.training.calculator:Calculator)

An episode (training/environments.py has the contract): the model's message either calls the tool,
`<tool>12+34</tool>`, and the calculator answers `<result>46</result>` (reward 0, the episode goes
on), or answers: the episode ends with reward 1 when the answer (the text of its last <answer>..</answer>
if it has one, else the whole message, without surrounding white space) equals the record's, else 0.
A tool call it cannot evaluate answers `<result>error</result>`, reward 0 (short, so that it fits the
small budgets of tiny models; `evaluate` raises `NotEvaluated` saying why).

The arithmetic is parsed, never eval'ed: integers and decimals, + - * / // % ** and unary minus, with
parentheses; numbers beyond 1e12 (and exponents beyond 64) are refused so that no call can take long.
"""

from __future__ import annotations

import ast
import operator
import re

from maxtrain.training import rewards

TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
LIMIT = 1e12          # the largest magnitude of a number in or out of an expression
MAX_EXPONENT = 64
MAX_LENGTH = 200      # characters of an expression
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class NotEvaluated(ValueError):
    """An expression the calculator does not evaluate (the message says why)."""


def _checked(value):
    if abs(value) > LIMIT:
        raise NotEvaluated(f"a number beyond {LIMIT:g}")
    return value


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise NotEvaluated(f"an exponent beyond {MAX_EXPONENT}")
        try:
            return _checked(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise NotEvaluated("division by zero") from None
        except (OverflowError, TypeError):  # a float overflow; a negative number to a fractional power
            raise NotEvaluated("a result out of range") from None
    raise NotEvaluated("only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (an integral value without '.0'); NotEvaluated when
    it is not one the calculator evaluates. ast.parse only reads the text: nothing in it is run."""
    text = expression.strip()
    if not text or len(text) > MAX_LENGTH:
        raise NotEvaluated(f"an expression of 1 to {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise NotEvaluated("not an arithmetic expression") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class Calculator:
    """One episode of the arithmetic task with a calculator tool (the module's docstring)."""

    def __init__(self):
        self.answer = ""

    def reset(self, record: dict):
        self.answer = record["answer"].strip()
        return None  # the record's prompt as the data renders it

    def step(self, message: str):
        call = TOOL.search(message)
        if call is not None:
            try:
                return f"<result>{evaluate(call.group(1))}</result>", 0.0, False
            except NotEvaluated:
                return "<result>error</result>", 0.0, False
        return "", float(rewards.completion_answer(message) == self.answer), True

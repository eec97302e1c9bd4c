"""The tasks: data rows -> examples of (context, continuation) requests, in lm-eval's stock formats.

Every task is scored by the log-likelihood of continuations, as lm-eval 0.4's `multiple_choice` and
`loglikelihood` tasks are. The prompts below are lm-eval's stock ones (its task YAMLs, in words):

    hellaswag      "{activity_label}: {ctx_a} {ctx_b capitalized}" (cleaned of WikiHow's [bracketed]
                   artifacts) -> " {ending}", 4 endings                           acc, acc_norm
    arc_easy,      "Question: {question}\\nAnswer:" -> " {choice text}"             acc, acc_norm
    arc_challenge
    piqa           "Question: {goal}\\nAnswer:" -> " {sol1}" | " {sol2}"           acc, acc_norm
    winogrande     the sentence up to the blank with each option filled in -> " {the rest}"
                   (the context differs per choice, the continuation is shared)   acc
    boolq          "{passage}\\nQuestion: {question}?\\nAnswer:" -> " no" | " yes"  acc
    lambada        the passage without its last word -> " {last word}"            acc (greedy), perplexity
    mmlu           "The following are multiple choice questions (with answers) about {subject}.\\n\\n"
                   + "{question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:" -> " A" .. " D"   acc

Few-shot examples go before the question, each as "{context} {answer}\\n\\n" (MMLU's after its
subject line): MMLU takes the first N of the subject's dev split (lm-eval's `first_n`); the other
tasks ship only their evaluation split, so their N examples are drawn from it, never the question
itself, seeded by the example's index (the same prompt however many examples run).

Splits: the ones the data ships. ARC is its validation split (lm-eval's stock arc_* use test),
LAMBADA is OpenAI's test set (lm-eval's lambada_openai), MMLU its test split.
"""

from __future__ import annotations

import dataclasses
import random
import re

from maxtrain import config as config_lib
from maxtrain.evals import data as data_lib

MULTIPLE_CHOICE, LOGLIKELIHOOD = "multiple_choice", "loglikelihood"


@dataclasses.dataclass(frozen=True)
class Example:
    """One question: its requests (one per choice), the right choice, and what acc_norm divides by."""

    task: str
    index: int                                  # position in the task's example list
    requests: tuple[tuple[str, str], ...]       # (context, continuation) per choice
    gold: int                                   # index of the right request (LAMBADA: 0)
    choice_chars: tuple[int, ...]               # characters of each choice, for acc_norm
    doc_id: str                                 # where it came from: "<split row>" or "<subject>/<row>"
    subject: str = ""                           # MMLU only


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str
    metrics: tuple[str, ...]


SPECS = {
    "hellaswag": TaskSpec("hellaswag", MULTIPLE_CHOICE, ("acc", "acc_norm")),
    "arc_easy": TaskSpec("arc_easy", MULTIPLE_CHOICE, ("acc", "acc_norm")),
    "arc_challenge": TaskSpec("arc_challenge", MULTIPLE_CHOICE, ("acc", "acc_norm")),
    "piqa": TaskSpec("piqa", MULTIPLE_CHOICE, ("acc", "acc_norm")),
    "winogrande": TaskSpec("winogrande", MULTIPLE_CHOICE, ("acc",)),
    "boolq": TaskSpec("boolq", MULTIPLE_CHOICE, ("acc",)),
    "lambada": TaskSpec("lambada", LOGLIKELIHOOD, ("acc", "perplexity")),
    "mmlu": TaskSpec("mmlu", MULTIPLE_CHOICE, ("acc",)),
}


# --------------------------------------------------------------------------------------------
# One row -> (question text, choices, gold); for winogrande the choices are contexts
# --------------------------------------------------------------------------------------------


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(row):
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return (_hellaswag_clean(row["activity_label"] + ": " + ctx), [_hellaswag_clean(e) for e in row["endings"]],
            int(row["label"]))


def _arc(row):
    choices = row["choices"]
    return f"Question: {row['question']}\nAnswer:", list(choices["text"]), list(choices["label"]).index(row["answerKey"])


def _piqa(row):
    return f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"])


def _boolq(row):
    return f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], int(bool(row["answer"]))


def _mmlu(row):
    c = row["choices"]
    text = f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"
    return text, ["A", "B", "C", "D"], int(row["answer"])


def _winogrande(row):
    """(contexts, continuation, gold): the blank filled with each option, then the rest of the sentence."""
    sentence = row["sentence"]
    blank = sentence.index("_")
    contexts = [sentence[:blank] + option for option in (row["option1"], row["option2"])]
    return contexts, " " + sentence[blank + 1:].strip(), {"1": 0, "2": 1}[row["answer"]]


QUESTIONS = {"hellaswag": _hellaswag, "arc_easy": _arc, "arc_challenge": _arc, "piqa": _piqa, "boolq": _boolq,
             "mmlu": _mmlu}


def _shot(task: str, row) -> str:
    """One few-shot example as "{context} {answer}\\n\\n"."""
    if task == "winogrande":
        contexts, continuation, gold = _winogrande(row)
        return contexts[gold] + continuation + "\n\n"
    if task == "lambada":
        return row["request"]["context"] + row["request"]["continuation"] + "\n\n"
    text, choices, gold = QUESTIONS[task](row)
    return f"{text} {choices[gold]}\n\n"


def _example(task: str, index: int, row, prefix: str, doc_id: str, subject: str = "") -> Example:
    if task == "winogrande":
        contexts, continuation, gold = _winogrande(row)
        return Example(task, index, tuple((prefix + c, continuation) for c in contexts), gold,
                       tuple(len(c) for c in contexts), doc_id)
    if task == "lambada":
        request = row["request"]
        return Example(task, index, ((prefix + request["context"], request["continuation"]),), 0,
                       (len(request["continuation"]),), doc_id)
    text, choices, gold = QUESTIONS[task](row)
    return Example(task, index, tuple((prefix + text, " " + c) for c in choices), gold,
                   tuple(len(c) for c in choices), doc_id, subject)


# --------------------------------------------------------------------------------------------
# A task's examples
# --------------------------------------------------------------------------------------------


def _sampled_prefix(task: str, rows: list, i: int, shots: int) -> str:
    if shots == 0:
        return ""
    others = random.Random(1234 + i).sample(range(len(rows) - 1), shots)
    return "".join(_shot(task, rows[j if j < i else j + 1]) for j in others)  # skips row i itself


def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def _mmlu_examples(files: dict[str, str], shots: int, max_examples: int) -> list[Example]:
    """MMLU's subjects in turn: the first question of each subject, then the second, ... (so the first
    57 x k examples are the first k of every subject, as lm-eval's --limit k)."""
    per_subject = {}
    for subject in data_lib.MMLU_SUBJECTS:
        dev = data_lib.read_rows(files[f"{subject}/dev"])
        if shots > len(dev):
            raise config_lib.ConfigError(f"mmlu:{shots} asks for {shots} few-shot examples, but {subject}'s dev split "
                                         f"has {len(dev)}; use at most mmlu:{len(dev)}")
        prefix = mmlu_description(subject) + "".join(_shot("mmlu", r) for r in dev[:shots])
        per_subject[subject] = (prefix, data_lib.read_rows(files[f"{subject}/test"]))
    order = [(s, i) for i in range(max(len(rows) for _, rows in per_subject.values()))
             for s in data_lib.MMLU_SUBJECTS if i < len(per_subject[s][1])]
    if max_examples > 0:
        order = order[:max_examples]
    return [_example("mmlu", n, per_subject[s][1][i], per_subject[s][0], f"{s}/{i}", s)
            for n, (s, i) in enumerate(order)]


def load_examples(task: str, files: dict[str, str], shots: int, max_examples: int = -1) -> list[Example]:
    """The task's examples (the first max_examples; -1 = all) with `shots` few-shot examples each."""
    if task == "mmlu":
        return _mmlu_examples(files, shots, max_examples)
    (split, path), = files.items()
    rows = data_lib.read_rows(path)
    if shots >= len(rows):
        raise config_lib.ConfigError(f"{task}:{shots} asks for {shots} few-shot examples but {task}'s {split} split "
                                     f"has {len(rows)} rows; use at most {task}:{len(rows) - 1}")
    count = len(rows) if max_examples <= 0 else min(max_examples, len(rows))
    return [_example(task, i, rows[i], _sampled_prefix(task, rows, i, shots), str(i)) for i in range(count)]

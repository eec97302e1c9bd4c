"""GRPO's input: jsonl/parquet records of a prompt and its answer -> left-padded prompt batches.

Records. `train_data_columns=[prompt, answer]` names the fields (the names are yours): the prompt is
a string (one user message) or a list of messages; the answer is what a reward function checks
(a string, or anything JSON turns into one). The prompt is rendered with the chat template and its
generation prompt (`<|im_start|>assistant\\n` for chatml), as SFT renders the turn before an
assistant reply, so a model post-trained with SFT continues it the same way.

Batches. Each host batch holds `rows` prompts (a step's completions / num_generations):
    prompt   int32 [rows, P]  left-padded to P = max_prefill_predict_length (pad id 0)
    first    int32 [rows]     the slot of each prompt's first token (P - its length)
    text     bytes [rows]     the rendered prompt (UTF-8)
    answer   bytes [rows]     the answer (UTF-8)
A prompt of more than P tokens stops the run with the record's file and line (the first record of
every file is checked before any work). The iterator is a checkpointable Grain iterator, so a
resumed run reads the prompts it would have read.

`stop_ids` are the tokens that end a completion: the tokenizer's end-of-sequence ids and the
template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`: the first token the template writes after
an assistant reply that is not white space; `\n` for the plain template).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from maxtrain.data import chat, conversations, sources, text_files
from maxtrain.data.errors import DataError
from maxtrain.errors import ConfigError


@dataclasses.dataclass
class Prompt:
    ids: np.ndarray     # int32 [n]
    text: str           # the rendered prompt
    answer: str


class ToPrompt:
    """(location, record) -> a Prompt of at most `length` tokens, else a DataError naming the record."""

    def __init__(self, template: chat.Template, columns: list[str], length: int, key: str = "train_data_columns"):
        self.template, self.columns, self.length, self.key = template, columns, length, key  # key: names the columns

    def prompt(self, located) -> Prompt:
        where, record = located
        missing = [c for c in self.columns if c not in record or record[c] is None]
        if missing:
            raise DataError(f"{where}: a GRPO row needs {' and '.join(map(repr, self.columns))}, but "
                            f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} missing (the record "
                            f"has: {', '.join(map(str, record)) or 'no fields'}). Fix the row, or name the fields with "
                            f"{self.key}=[{','.join(('prompt', 'answer')[:len(self.columns)])}] (your names)")
        value = record[self.columns[0]]
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        else:
            messages = chat.check_messages(value, f"{where} column {self.columns[0]!r}", need_assistant=False)
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: the prompt (column {self.columns[0]!r}) is empty, so there is nothing to "
                            "answer; fix or remove the row")
        text = self.template.render(messages, add_generation_prompt=True)
        ids, _ = chat.encode_parts(self.template, [(text, False)])
        if len(ids) == 0:
            raise DataError(f"{where}: the prompt (column {self.columns[0]!r}) renders to no tokens with the chat "
                            f"template {self.template.describe()}; fix the row, or use another chat_template")
        if len(ids) > self.length:
            raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than max_prefill_predict_length="
                            f"{self.length}; raise max_prefill_predict_length (and max_target_length with it: the "
                            "completion gets max_target_length - max_prefill_predict_length tokens) or shorten the prompt")
        answer = record[self.columns[1]] if len(self.columns) > 1 else ""  # distill_on_policy may read prompts alone
        return Prompt(ids, text, answer if isinstance(answer, str) else json.dumps(answer))

    def __call__(self, located) -> dict:
        p = self.prompt(located)
        prompt = np.zeros(self.length, np.int32)
        prompt[self.length - len(p.ids):] = p.ids
        return {"prompt": prompt, "first": np.int32(self.length - len(p.ids)), "text": np.bytes_(p.text.encode()),
                "answer": np.bytes_(p.answer.encode())}


def stop_ids(template: chat.Template) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence ids and the first token the template writes after an assistant reply."""
    tok = template.tokenizer
    marker = "\x1fANSWER\x1f"
    text = template.render([{"role": "assistant", "content": marker}])
    tail = text[text.index(marker) + len(marker):] if marker in text else ""
    ids = list(tok.eos_ids)
    after = tok.encode(tail) if tail else []
    # the first piece that writes something (a sentencepiece model starts with a bare "▁"); else the last
    marker_ids = [i for i in after if tok.decode([i]).strip()] or after[-1:]
    return tuple(dict.fromkeys(ids + marker_ids[:1]))


def columns(config, split: str) -> list[str]:
    return list(config.train_data_columns if split == "train" else config.eval_data_columns)


@dataclasses.dataclass
class PromptInputs:
    tokenizer: object
    template: chat.Template
    train_iterator: object        # checkpointable Grain iterator of host prompt batches (see above)
    eval_prompts: list            # held-out Prompts (grain_eval_files), [] without them
    stop_ids: tuple
    first_records: list           # the first record of every training file, as Prompts (reward checks)


def per_step(config) -> int:
    """Prompts per step: global_batch_size / num_generations (a ConfigError when it does not divide)."""
    rows, g = config.global_batch_size, config.num_generations
    if rows % g:
        near = min((d for d in range(2, rows + 1) if rows % d == 0), key=lambda d: abs(d - g), default=rows)
        raise ConfigError(f"objective=grpo: a step's {rows} completions (global_batch_size = per_device_batch_size x "
                          f"devices x gradient_accumulation_steps) are not a multiple of num_generations={g}; set "
                          f"per_device_batch_size so that they are (e.g. num_generations={near})")
    return rows // g


def per_host(config, count: int) -> int:
    """Prompts per step read by each of `count` hosts (GRPO's rollouts gather them: training/rollout/multihost.py)."""
    rows = per_step(config)
    if rows % count:
        raise ConfigError(f"objective=grpo: a step's {rows} prompts (global_batch_size / num_generations) do not split "
                          f"over the {count} trainer processes, each of which reads its own share; set "
                          f"per_device_batch_size or num_generations so that the prompts are a multiple of {count}")
    return rows // count


def make_inputs(config, rows: int, index: int = 0, count: int = 1, log=print) -> PromptInputs:
    """The prompts of a GRPO run, `rows` per host batch; every file is listed and its first record checked here."""
    tokenizer = sources.load_tokenizer(config, None, None)
    template = conversations.open_template(config, tokenizer)
    length = config.max_prefill_predict_length
    train = sources.parse_files(config.grain_train_files, "grain_train_files", config.dataset_type)
    evals = (sources.parse_files(config.grain_eval_files, "grain_eval_files", config.dataset_type)
             if config.grain_eval_files else [])
    first = []
    for key, components, split in (("grain_train_files", train, "train"), ("grain_eval_files", evals, "eval")):
        to_prompt = ToPrompt(template, columns(config, split), length, f"{split}_data_columns")
        for c in components:
            for path in c.files:
                fmt, _ = text_files.file_format(path)
                if fmt != config.dataset_type:
                    raise DataError(f"{key}: {path} is a {fmt} file but dataset_type={config.dataset_type}")
                record = next((r for r in conversations.read_records(path, key=f"{split}_data_columns")
                               if r[1] is not None), None)
                if record is None:
                    raise DataError(f"{path} holds no records: an empty shard. Delete it or narrow the glob.")
                checked = to_prompt.prompt(record)
                if split == "train":
                    first.append(checked)
    files = [f for c in train for f in sources.host_files(c, "grain_train_files", index, count, log, required=True)]
    ds = conversations.RecordsIterDataset(files, None, sources.data_seed(config, "files/0"),
                                          config.enable_data_shuffling, f"grain_train_files on host {index}")
    if config.enable_data_shuffling and config.grain_shuffle_window > 1:
        ds = sources.WindowShuffleIterDataset(ds, config.grain_shuffle_window, sources.data_seed(config, "window/0"))
    batches = ds.map(ToPrompt(template, columns(config, "train"), length)).batch(rows, drop_remainder=True)
    eval_prompts = []
    if evals and config.eval_interval != -1:
        to_prompt = ToPrompt(template, columns(config, "eval"), length, "eval_data_columns")
        located = (r for c in evals for path in c.files
                   for r in conversations.read_records(path, key="eval_data_columns") if r[1] is not None)
        # HeldOut answers them global_batch_size at a time on every host (each reads them all): not `rows`, which is
        # this host's share of a step's prompts
        limit = None if config.eval_steps <= 0 else config.eval_steps * config.global_batch_size
        eval_prompts = [to_prompt.prompt(r) for r in itertools.islice(located, limit)]
    stops = stop_ids(template)
    log(f"GRPO prompts rendered with the chat template {template.describe()}, left-padded to "
        f"{length} tokens; completions end at token ids {list(stops)}; {len(eval_prompts)} held-out prompts")
    return PromptInputs(tokenizer, template, iter(batches), eval_prompts, stops, first)

"""Post-training input: jsonl/parquet records of conversations (objective=sft) or preference pairs (objective=dpo)
-> rendered, tokenized elements with loss weights -> packed rows -> host batches.

Records. `train_data_columns` names the fields: [messages] (a list of {role, content}) or
[prompt, completion] for SFT, [prompt, chosen, rejected] for DPO (each a string, or a list of
messages). Every record is checked as it is read; a bad one stops the run with its file and line.
Before training, the first record of every file is rendered, so a missing field, an unknown role,
a conversation without an assistant turn or a tokenizer without a chat template fail at once.

Packing. Elements (a conversation, or a DPO pair's two sequences) are never split: with
packing=true whole elements go into the first row with room (first_fit, whatever
grain_packing_type says), else one per row. Every element gets its own segment ids (a DPO pair
two: 2k-1 chosen, 2k rejected) and positions restarting at 0, so attention never crosses from one
conversation into another. An element longer than max_target_length + 1 tokens is truncated (a
DPO pair: each sequence to half), and the count is reported in a warning.

Records whose messages hold images (a model with an image tower) are image_conversations.py's.

The file reading, shuffling and host sharding are sources.py's (jsonl/parquet: by file, a window
shuffle); the iterator is checkpointable end to end, as for pre-training.
"""

from __future__ import annotations

import functools
import itertools
import json

import grain
import numpy as np
from grain import experimental as grain_exp

from maxtrain.config import objectives
from maxtrain.data import chat, eval_batches, hosts, image_conversations, pipeline, sources, text_files
from maxtrain.data.errors import DataError

FEATURES = ("tokens", "weights", "parts", "positions")


# --------------------------------------------------------------------------------------------
# Reading records
# --------------------------------------------------------------------------------------------


def read_records(path: str, skip: int = 0, key: str = "train_data_columns"):
    """(location, record dict) of every record of a jsonl or parquet file, after `skip` records (`key`: the
    setting that names the record's columns, for messages)."""
    fmt, compression = text_files.file_format(path)
    if fmt == "parquet":
        pf = text_files.open_parquet(path)  # local or gs://; not parquet: a DataError naming the file
        row = 0
        for group in range(pf.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            if row + rows <= skip:
                row += rows
                continue
            for i, record in enumerate(pf.read_row_group(group).to_pylist()):
                if row + i >= skip:
                    yield f"{path} row {row + i}", record
            row += rows
        return
    if fmt != "jsonl":
        raise DataError(f"{path}: conversations and preference pairs are read from .jsonl or .parquet files, not {fmt}")
    stream, raw = text_files.open_text(path, compression)
    with raw:
        for number, line in enumerate(stream, start=1):
            if number <= skip:
                continue
            where = f"{path} line {number}"
            text = text_files.decode_text(line, where).strip()
            if not text:
                yield where, None
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}). Each line of a .jsonl file "
                                "must be one JSON object; fix or remove the line.") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: a {type(record).__name__}, not a JSON object with the columns "
                                f"{key} names; fix or remove the line")
            yield where, record


class _RecordsIterator(grain.DatasetIterator):
    """State: (epoch, file of this epoch's order, records read from it)."""

    def __init__(self, ds: "RecordsIterDataset"):
        super().__init__()
        self._ds = ds
        self._epoch, self._file, self._record, self._docs = 0, 0, 0, 0
        self._records = None

    def _path(self) -> str:
        files = self._ds.files
        if not self._ds.shuffle_files:
            return files[self._file]
        return files[np.random.default_rng([self._ds.seed, self._epoch]).permutation(len(files))[self._file]]

    def __next__(self):
        ds = self._ds
        while ds.files and (ds.num_epochs is None or self._epoch < ds.num_epochs):
            if self._records is None:
                self._records = read_records(self._path(), skip=self._record, key=self._ds.key)
            for where, record in self._records:
                self._record += 1
                if record is not None:
                    self._docs += 1
                    return where, record
            self._records, self._file, self._record = None, self._file + 1, 0
            if self._file == len(ds.files):
                if self._docs == 0:
                    raise DataError(f"{ds.what}: the files hold no records")
                self._epoch, self._file, self._docs = self._epoch + 1, 0, 0
        raise StopIteration

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "file": self._file, "record": self._record, "docs": self._docs}

    def set_state(self, state: dict) -> None:
        self._epoch, self._file, self._record, self._docs = (state["epoch"], state["file"], state["record"],
                                                             state["docs"])
        self._records = None


class RecordsIterDataset(grain.IterDataset):
    """(location, record) of `files`, file after file, for num_epochs (None: forever)."""

    def __init__(self, files, num_epochs, seed: int, shuffle_files: bool, what: str, key: str = "train_data_columns"):
        super().__init__()
        self.files, self.num_epochs, self.seed, self.shuffle_files, self.what = files, num_epochs, seed, shuffle_files, what
        self.key = key  # the setting that names the columns, for messages

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        del sequential_slice
        self.files = self.files[sl]

    def __iter__(self):
        return _RecordsIterator(self)


# --------------------------------------------------------------------------------------------
# Records -> elements -> rows
# --------------------------------------------------------------------------------------------


class ToElement:
    """(location, record) -> a packing element of at most length tokens (picklable, for Grain workers)."""

    def __init__(self, template: chat.Template, config, columns: list[str], length: int, log=print,
                 key: str = "train_data_columns", vision=None):
        self.template, self.columns, self.length, self.log, self.key = template, columns, length, log, key
        self.config, self.vision = config, vision  # vision: to say why a record's images cannot be read
        self.dpo = objectives.data_kind(config) == objectives.PAIRS
        self.completion_only = config.sft_train_on_completion_only
        self.truncated, self.passes = 0, 0  # passes > 1: the same data again (eval), counted once

    def unchanged(self, located) -> dict:
        """The record's element before truncation."""
        where, record = located
        if self.dpo:
            return chat.dpo_element(self.template, *chat.preference(record, self.columns, where, self.key), where)
        if image_conversations.has_images(record, self.columns):
            image_conversations.refuse(self.config, self.vision, where)
        return chat.sft_element(self.template, chat.conversation(record, self.columns, where, self.key),
                                self.completion_only, where)

    def __call__(self, located) -> dict:
        where = located[0]
        element, cut = chat.truncate(self.unchanged(located), self.length)
        if cut and self.passes <= 1:
            self.truncated += 1
            if self.truncated & (self.truncated - 1) == 0:  # 1, 2, 4, 8, ...: a count, not a flood
                what = "preference pairs" if self.dpo else "conversations"
                self.log(f"warning: {self.truncated} {what} so far were longer than max_target_length + 1 = "
                         f"{self.length} tokens and were truncated (e.g. {where}); raise max_target_length to keep "
                         "them whole")
        return element


def converter(template, config, split: str, log=print, vision=None):
    """The record -> element map of a split: ToElement, or for a model with an image tower (vision: the bound
    model's contract.Vision) image_conversations'."""
    args = (config, columns(config, split), config.max_target_length + 1)
    if image_conversations.active(config, vision):
        return image_conversations.converter(template, config, vision, *args[1:], log, f"{split}_data_columns")
    return ToElement(template, *args, log, f"{split}_data_columns", vision)


def to_example(row: dict) -> dict:
    """A packed row of T + 1 tokens -> inputs/targets/positions/segment_ids/loss_weights [T]."""
    packed = row["tokens_segment_ids"]
    seg = np.where(packed > 0, 2 * packed - 2 + row["parts"], 0).astype(np.int32)
    weights = row["weights"][1:] * ((seg[1:] == seg[:-1]) & (seg[:-1] != 0))
    return {"inputs": row["tokens"][:-1], "targets": row["tokens"][1:], "positions": row["positions"][:-1],
            "segment_ids": seg[:-1], "loss_weights": weights.astype(np.float32)}


def _single_row(element: dict, length: int) -> dict:
    n = len(element["tokens"])
    row = {k: np.zeros(length, v.dtype) for k, v in element.items()}
    for k, v in element.items():
        row[k][:n] = v
    row["tokens_segment_ids"] = (np.arange(length) < n).astype(np.int32)
    return to_example(row)


def rows(elements: grain.IterDataset, config, num_rows: int) -> grain.IterDataset:
    """Examples [T] of whole elements: first_fit packing into `num_rows` open rows, or one per row."""
    length = config.max_target_length + 1
    if not config.packing:
        return elements.map(functools.partial(_single_row, length=length))
    packed = grain_exp.FirstFitPackIterDataset(elements, length_struct={k: length for k in FEATURES},
                                               num_packing_bins=num_rows, shuffle_bins=False)
    return packed.map(to_example)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def columns(config, split: str) -> list[str]:
    return list(config.train_data_columns if split == "train" else config.eval_data_columns)


def open_template(config, tokenizer) -> chat.Template:
    return chat.template_for(tokenizer, config.chat_template)


def learnable(element: dict) -> bool:
    """Whether an element (after truncation) has a token to learn from in each of its sequences (a DPO pair's chosen
    and rejected completions both): a weighted token after the first of its sequence."""
    return all((element["weights"][element["parts"] == part][1:] != 0).any() for part in np.unique(element["parts"]))


def whole_length(element: dict) -> int:
    """The least max_target_length that keeps an element whole (a DPO pair: each sequence gets half the row)."""
    if element["parts"].max() == 1:
        return len(element["tokens"]) - 1
    return 2 * max(int((element["parts"] == part).sum()) for part in np.unique(element["parts"])) - 1


def check_first_records(components, template: chat.Template, config, split: str, vision=None) -> None:
    """Renders the first record of every file now, so bad data fails before any training step; where none of them
    keeps a token to learn from once truncated to the sequence, the run (or its evaluation) would learn nothing
    (loss 0, gradient 0): refused with the length that keeps them."""
    key = f"{split}_data_columns"
    convert = converter(template, config, split, lambda *_: None, vision)
    firsts = []
    for component in components:
        for path in component.files:
            first = next((r for r in read_records(path, key=key) if r[1] is not None), None)
            if first is None:
                raise DataError(f"{path} holds no records: an empty shard. Delete it or narrow the glob.")
            element = convert(first)
            if learnable(element):
                return  # a usable example: the rest is counted as it is read (ToElement's warning)
            firsts.append((first[0], whole_length(convert.unchanged(first))))
    if firsts:
        where, needed = min(firsts, key=lambda f: f[1])
        dpo = getattr(convert, "dpo", False)
        what = "preference pair" if dpo else "conversation"
        raise DataError(f"the first {what} of every {split} file leaves no token to learn from at max_target_length="
                        f"{config.max_target_length} (each is truncated to max_target_length + 1 tokens"
                        + (", half for each sequence of a pair" if dpo else "")
                        + ", losing every completion token): the "
                        + ("run would learn" if split == "train" else "evaluation would measure")
                        + f" nothing (loss 0). Raise max_target_length to {needed} or more (e.g. {where} needs "
                        f"{needed}), or shorten the prompts")


def elements(files, config, template, split: str, num_epochs, seed: int, shuffle: bool, what: str, log,
             convert=None):
    ds = RecordsIterDataset(files, num_epochs, seed, shuffle, what)
    if shuffle and split == "train" and config.grain_shuffle_window > 1:
        ds = sources.WindowShuffleIterDataset(ds, config.grain_shuffle_window, sources.data_seed(config, "window/0"))
    return ds.map(convert or converter(template, config, split, log))


def packed_rows(elements_ds, config, num_rows: int, images: bool = False):
    """Packed examples: image conversations' rows (tokens and patches) or text ones."""
    if images:
        return image_conversations.rows(elements_ds, config, num_rows, to_example)
    return rows(elements_ds, config, num_rows)


def make_inputs(config, index: int, count: int, log=print, vision=None):
    """(tokenizer, train iterator, eval batches, sources) for conversations and preference pairs; vision: the bound
    model's contract.Vision (None: a text model), which reads image conversations."""
    tokenizer = sources.load_tokenizer(config, None, None)
    template = open_template(config, tokenizer)
    train = sources.parse_files(config.grain_train_files, "grain_train_files", config.dataset_type)
    evals = (sources.parse_files(config.grain_eval_files, "grain_eval_files", config.dataset_type)
             if config.grain_eval_files else [])
    for key, components in (("grain_train_files", train), ("grain_eval_files", evals)):
        for c in components:
            for path in c.files:
                fmt, _ = text_files.file_format(path)
                if fmt != config.dataset_type:
                    raise DataError(f"{key}: {path} is a {fmt} file but dataset_type={config.dataset_type}")
    check_first_records(train, template, config, "train", vision)
    check_first_records(evals, template, config, "eval", vision)
    pairs = objectives.data_kind(config) == objectives.PAIRS
    log(f"{'preference pairs' if pairs else 'conversations'} rendered with the chat template {template.describe()}"
        + ("" if pairs else "; loss on " + ("assistant tokens only" if config.sft_train_on_completion_only
                                             else "every token")))
    if config.dataset_cache_dir:
        log(f"note: dataset_cache_dir={config.dataset_cache_dir!r} is not used with objective={config.objective}: "
            "records are rendered and tokenized as they are read (the chat template decides the tokens and their "
            "weights)")

    epochs = None if config.num_epoch == -1 else config.num_epoch
    files = [f for c in train for f in sources.host_files(
        c, "grain_train_files", index, count, log, required=True)]
    accum, micro = config.gradient_accumulation_steps, hosts.host_micro_batch(config)
    convert = converter(template, config, "train", log, vision)
    images = isinstance(convert, image_conversations.ToImageElement)
    finish = image_conversations.finisher(config, convert) if images else None
    if images and config.grain_worker_count == 0:
        log("note: images are decoded and preprocessed in the training process (grain_worker_count=0); set "
            "grain_worker_count to 1 or more to do it in Grain's worker processes, beside the training steps")
    docs = elements(files, config, template, "train", epochs, sources.data_seed(config, "files/0"),
                    config.enable_data_shuffling, f"grain_train_files on host {index}", log, convert)
    train_it = pipeline.train_iterator_from_rows(packed_rows(docs, config, accum * micro, images), config, index, log,
                                                 finish)

    eval_input = []
    if evals and config.eval_interval != -1:
        eval_files = hosts.file_shards([f for c in evals for f in c.files], index, count)

        to_element = converter(template, config, "eval", log, vision)
        eval_finish = (image_conversations.EvalImages(image_conversations.finisher(config, to_element))
                       if isinstance(to_element, image_conversations.ToImageElement) else None)

        def make():  # one ToElement for every pass, so truncations are counted (and warned about) once
            ds = RecordsIterDataset(eval_files, 1, 0, False, f"grain_eval_files on host {index}",
                                    "eval_data_columns").map(to_element)
            to_element.passes += 1
            batches = packed_rows(ds, config, micro, eval_finish is not None).batch(micro, drop_remainder=False)
            batches = batches.map(functools.partial(hosts.fill_rows, rows=micro))
            return iter(batches if eval_finish is None else batches.map(eval_finish))

        limit = config.eval_steps if config.eval_steps > 0 else None
        local = sum(1 for _ in itertools.islice(make(), limit))
        counts = hosts.agree(local, count)
        if max(counts) == 0:
            raise DataError("the eval data gives no batches; fix grain_eval_files, or set eval_interval=-1")
        num = limit or max(counts)
        eval_input = eval_batches.EvalInput(make, num, min(local, num), micro, config.max_target_length)
        log(f"eval: {num} batches of {micro} x {config.max_target_length} per evaluation (host {index}: "
            f"{min(local, num)} real)")
    return tokenizer, train_it, eval_input, sources.Sources(config.dataset_type, tokenizer, train, evals)

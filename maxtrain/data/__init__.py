"""Input pipelines. `make_inputs(config) -> Inputs` is the one entry point the trainer uses.

    sources.py      where documents come from (default corpus, ArrayRecord, jsonl, parquet; mixtures)
    cache.py        jsonl/parquet tokenized once into a cache, in the background, while training reads it
    prepared.py     the prepared-data format (tokenized ArrayRecord shards + metadata.json)
    prepare.py      raw text -> prepared data (scripts/prepare_data.py), text_files.py reads raw text
    tokenizer.py    load(path): sentencepiece models and Hugging Face tokenizer.json / model directories
    tokenizer_training.py  training either kind (scripts/train_tokenizer.py, the default corpus)
    chat.py         chat templates; conversations and preference pairs -> ids with loss weights
    conversations.py  conversations / preference pairs (objective=sft, dpo) -> packed rows (whole conversations)
    prompts.py      prompts and their answers (objective=grpo) -> left-padded prompt batches
    packing.py      documents -> rows with segment ids and positions
    hosts.py        host sharding, padding batches, host batch -> global jax.Array
    eval_batches.py eval batches: first N, or exactly one epoch, the same count on every host
    pipeline.py     the training iterator (checkpointable Grain DatasetIterator) and synthetic data
    images.py       images -> pixel arrays and placeholder counts (Qwen-VL, Gemma 4; images_llama4.py: Llama 4;
                    towers.py: a model's scheme, from its tower's config)

`tokenizer_for(config)` is the tokenizer a model was trained with (the tools use it). May import
parallel, config and the base modules.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from maxtrain.config import objectives
from maxtrain.data import default_corpus
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data.errors import DataError  # noqa: F401 (re-exported)
from maxtrain.errors import ConfigError

# JAX and Grain (~1.8 s together, measured) are imported inside make_inputs, so that the preparation workers
# (which import maxtrain.data.prepare) start without them.


@dataclasses.dataclass
class Inputs:
    tokenizer: Any                 # tokenizer.Tokenizer, or None for synthetic data
    train_iterator: Any            # checkpointable Grain DatasetIterator of host batches [A, b, T]
    eval_batches: Any              # re-iterable: the same len(eval_batches) host batches [b, T] each pass
    sources: Any = None            # sources.Sources: what was opened (for inspect_data)
    prompts: Any = None            # prompts.PromptInputs of a run that reads prompts (GRPO): stop ids, first records

    def close(self) -> None:
        """Stops background work (cache building); call when training ends."""
        if self.sources is not None:
            self.sources.close()


def make_inputs(config, log=print, process_index: int | None = None, process_count: int | None = None,
                vision=None) -> Inputs:
    """This process' inputs, of the data kind the objective's row declares (config/objectives.py): text documents,
    conversations or preference pairs through the chat template, or prompts (GRPO; eval_batches are then the
    held-out prompts). All files are listed and checked here, before any training step. vision: the bound model's
    image tower (its family's contract.Vision, or None), which reads image conversations
    (image_conversations.py)."""
    import jax  # pylint: disable=import-outside-toplevel

    # deferred: Grain and JAX (see above)
    from maxtrain.data import eval_batches, pipeline, sources  # pylint: disable=import-outside-toplevel

    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if config.dataset_type == "synthetic":  # random tokens; a tokenizer_path is still the model's (samples, eval_tasks)
        return Inputs(tokenizer_for(config, log) if config.tokenizer_path else None,
                      pipeline.synthetic_iterator(config, index), [])
    kind = objectives.data_kind(config)  # what the objective's row reads
    if kind == objectives.PROMPTS:  # GRPO's prompts and answers, left-padded (training/grpo.py adds the rewards)
        from maxtrain.data import prompts  # pylint: disable=import-outside-toplevel  (deferred: as above)

        read = prompts.make_inputs(config, prompts.per_host(config, count), index, count, log)
        return Inputs(read.tokenizer, read.train_iterator, read.eval_prompts, prompts=read)
    if kind in (objectives.CONVERSATIONS, objectives.PAIRS):  # through the chat template
        from maxtrain.data import conversations  # pylint: disable=import-outside-toplevel  (deferred: as above)

        return Inputs(*conversations.make_inputs(config, index, count, log, vision))
    opened = sources.open_sources(config, log=log)
    train = pipeline.train_iterator(sources.train_documents(opened, config, index, count, log), config, index, log)
    evals = []
    if opened.eval and config.eval_interval != -1:
        evals = eval_batches.make_eval_input(opened, config, index, count, log)
    return Inputs(opened.tokenizer, train, evals, opened)


def tokenizer_for(config, log=print):
    """The tokenizer a model of `config` was trained with: tokenizer_path, or for dataset_type=default the
    default corpus' (trained and cached on first use); refused when it has more pieces than vocab_size."""
    if config.tokenizer_path:
        tokenizer = tokenizer_lib.load(config.tokenizer_path)
        tokenizer_lib.check_vocab(tokenizer, config.vocab_size)
        return tokenizer
    if config.dataset_type == "default":
        return default_corpus.tokenizer(config, log=log)
    if config.dataset_type == "arrayrecord" and config.grain_train_files:  # prepared data keeps its tokenizer's copy
        from maxtrain.data import prepared, sources  # pylint: disable=import-outside-toplevel  (deferred: Grain)

        first = sources.parse_files(config.grain_train_files, "grain_train_files", "arrayrecord")[0].files[0]
        directory = os.path.dirname(first)
        return sources.load_tokenizer(config, prepared.read_metadata(directory)["tokenizer"], directory, log)
    raise ConfigError(f"dataset_type={config.dataset_type} has no tokenizer of its own; pass "
                      "tokenizer_path=<the tokenizer the checkpoint was trained with: a sentencepiece .model, "
                      "a Hugging Face tokenizer.json or model directory>")

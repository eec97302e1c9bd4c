"""Input pipelines. `make_inputs(config) -> Inputs` is the one entry point the trainer uses.

    sources.py      where documents come from (default corpus, ArrayRecord, jsonl, parquet; mixtures)
    cache.py        jsonl/parquet tokenized once into a cache, in the background, while training reads it
    prepared.py     the prepared-data format (tokenized ArrayRecord shards + metadata.json)
    prepare.py      raw text -> prepared data (scripts/prepare_data.py), text_files.py reads raw text
    tokenizer.py    load(path): sentencepiece models and Hugging Face tokenizer.json / model directories
    tokenizer_training.py  training either kind (scripts/train_tokenizer.py, the default corpus)
    packing.py      documents -> rows with segment ids and positions
    hosts.py        host sharding, padding batches, host batch -> global jax.Array
    evaluation.py   eval batches: first N, or exactly one epoch, the same count on every host
    pipeline.py     the training iterator (checkpointable Grain DatasetIterator) and synthetic data
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxtrain.data.errors import DataError  # noqa: F401 (re-exported)

# JAX and Grain are imported inside make_inputs, so that the preparation workers (which import
# maxtrain.data.prepare) start without them.


@dataclasses.dataclass
class Inputs:
    tokenizer: Any                 # tokenizer.Tokenizer, or None for synthetic data
    train_iterator: Any            # checkpointable Grain DatasetIterator of host batches [A, b, T]
    eval_batches: Any              # re-iterable: the same len(eval_batches) host batches [b, T] each pass
    sources: Any = None            # sources.Sources: what was opened (for inspect_data)

    def close(self) -> None:
        """Stops background work (cache building); call when training ends."""
        if self.sources is not None:
            self.sources.close()


def make_inputs(config, log=print, process_index: int | None = None, process_count: int | None = None) -> Inputs:
    """This process' inputs. All files are listed and checked here, before any training step."""
    import jax  # pylint: disable=import-outside-toplevel

    from maxtrain.data import evaluation, pipeline, sources  # pylint: disable=import-outside-toplevel

    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if config.dataset_type == "synthetic":
        return Inputs(None, pipeline.synthetic_iterator(config, index), [])
    opened = sources.open_sources(config, log=log)
    train = pipeline.train_iterator(sources.train_documents(opened, config, index, count, log), config, index, log)
    evals = []
    if opened.eval and config.eval_interval != -1:
        evals = evaluation.make_eval_input(opened, config, index, count, log)
    return Inputs(opened.tokenizer, train, evals, opened)

"""The bad-input rows of python -m maxtrain.inspect_data: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

ROWS = [
    # inspect_data
    Row("inspect-data-host-out-of-range", "inspect_data", [B, "num_processes=2", "process_id=3"],
        r"process_id=3 must be in \[0, num_processes=2\)"),
    Row("inspect-data-not-parquet", "inspect_data", [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                                     "grain_train_files={data}/not.parquet"],
        r"not.parquet: not a readable parquet file", tiny=True),
    Row("inspect-data-bad-utf8", "inspect_data", [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                  "grain_train_files={data}/bad_utf8.jsonl"],
        r"bad_utf8.jsonl line 1: invalid UTF-8", tiny=True),
    Row("inspect-data-batches-not-a-number", "inspect_data", ["--batches", "two", B],
        r"argument --batches: invalid int value: 'two'"),
    Row("inspect-data-unknown-key", "inspect_data", [B, "grain_train_file=x"], r"unknown config key 'grain_train_file'"),
    Row("inspect-data-mixture-weight", "inspect_data", [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                        "grain_train_files={data}/good*:-1"],
        r"the weight of '.*/good\*' is -1; weights must be finite and > 0", tiny=True),
]

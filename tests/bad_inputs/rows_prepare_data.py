"""The bad-input rows of scripts/prepare_data.py: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

ROWS = [
    # prepare_data
    Row("prepare-input-matches-nothing", "prepare_data", ["--input", "{data}/none*.jsonl", "--tokenizer", "{tok}",
                                                          "--output-dir", "{scratch}/out"],
        r"--input '.*/none\*.jsonl' matches no files"),
    Row("prepare-input-a-directory", "prepare_data", ["--input", "{data}", "--tokenizer", "{tok}",
                                                      "--output-dir", "{scratch}/out"],
        r"--input '.*/data' is a directory, not a glob of files: name its files, e.g. '.*/data/\*\.jsonl'"),
    Row("prepare-tokenizer-missing", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer",
                                                      "{scratch}/none.model", "--output-dir", "{scratch}/out"],
        r"--tokenizer '.*/none.model' does not exist"),
    Row("prepare-tokenizer-garbage", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer",
                                                      "{root}/garbage.model", "--output-dir", "{scratch}/out"],
        r"garbage.model'? is not a (valid )?sentencepiece model"),
    Row("prepare-eval-fraction", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                  "--output-dir", "{scratch}/out", "--eval-fraction", "1.5"],
        r"--eval-fraction=1.5 must be in \[0, 1\)"),
    Row("prepare-shard-mb-zero", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                  "--output-dir", "{scratch}/out", "--shard-mb", "0"],
        r"--shard-mb=0.0 must be a number > 0"),
    Row("prepare-workers-zero", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                 "--output-dir", "{scratch}/out", "--workers", "0"],
        r"--workers=0 must be at least 1"),
    Row("prepare-other-tokenizer", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer",
                                                    "{scratch}/other.model", "--output-dir", "{prepared}",
                                                    "--workers", "1"],
        r"--output-dir .*/prepared was prepared with another tokenizer .* pass --overwrite",
        setup=lambda w, s: other_tokenizer(w, s)),
    Row("prepare-output-is-a-file", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                     "--output-dir", "{scratch}/afile", "--workers", "1"],
        r"--output-dir .*/afile is a file, not a directory", setup=a_file),
    Row("prepare-not-parquet", "prepare_data", ["--input", "{data}/not.parquet", "--tokenizer", "{tok}",
                                                "--output-dir", "{scratch}/out", "--workers", "1"],
        r"not.parquet: not a readable parquet file"),
    Row("prepare-no-text-field", "prepare_data", ["--input", "{data}/no_field.jsonl", "--tokenizer", "{tok}",
                                                  "--output-dir", "{scratch}/out", "--workers", "1"],
        r"no_field.jsonl line 1: no 'text' field"),
    Row("prepare-unknown-file-type", "prepare_data", ["--input", "{data}/table.csv", "--tokenizer", "{tok}",
                                                      "--output-dir", "{scratch}/out"],
        r"table.csv: unknown file type"),
]

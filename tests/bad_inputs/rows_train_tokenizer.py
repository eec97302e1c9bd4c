"""The bad-input rows of scripts/train_tokenizer.py: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

ROWS = [
    # train_tokenizer
    Row("tokenizer-vocab-tiny", "train_tokenizer", ["--input", "{data}/good.jsonl", "--vocab-size", "3",
                                                    "--output", "{scratch}/t.model"],
        r"--vocab-size 3 is too small"),
    Row("tokenizer-vocab-below-characters", "train_tokenizer", ["--input", "{data}/chars.txt", "--vocab-size", "50",
                                                                "--output", "{scratch}/t.model"],
        r"--vocab-size 50 is too small for this text: .* Use --vocab-size \d+ or more"),
    Row("tokenizer-hf-vocab-below-bytes", "train_tokenizer", ["--kind", "hf", "--input", "{data}/good.jsonl",
                                                              "--vocab-size", "100", "--output", "{scratch}/t/"],
        r"--vocab-size 100 is too small for a byte-level BPE: .* Use --vocab-size 259 or more"),
    Row("tokenizer-vocab-above-text", "train_tokenizer", ["--input", "{data}/no_field.jsonl", "--text-field", "body",
                                                          "--vocab-size", "5000", "--output", "{scratch}/t.model"],
        r"--vocab-size 5000 is more pieces than sentencepiece can learn from this text \(at most \d+"),
    Row("tokenizer-input-matches-nothing", "train_tokenizer", ["--input", "{data}/none*.txt", "--output",
                                                               "{scratch}/t.model"], r"--input '.*' matches no files"),
    Row("tokenizer-input-a-prepared-directory", "train_tokenizer", ["--input", "{prepared}", "--output",
                                                                    "{scratch}/t.model"],
        r"--input '.*/prepared' is a directory of prepared \(tokenized\) data, not text: give the raw text files"),
    Row("tokenizer-output-is-a-directory", "train_tokenizer", ["--input", "{data}/good.jsonl", "--output", "{scratch}"],
        r"--output .* is a directory"),
    Row("tokenizer-output-under-a-file", "train_tokenizer", ["--input", "{data}/good.jsonl", "--output",
                                                             "{scratch}/afile/t.model"],
        r"--output .*/afile/t.model cannot be (written|created): .*/afile is a file", setup=a_file),
    Row("tokenizer-hf-output-under-a-file", "train_tokenizer", ["--kind", "hf", "--input", "{data}/good.jsonl",
                                                                "--vocab-size", "300", "--output", "{scratch}/afile/tok"],
        r"--output .*/afile/tok cannot be created: .*/afile is a file, not a directory", setup=a_file),
    Row("tokenizer-max-mb-zero", "train_tokenizer", ["--input", "{data}/good.jsonl", "--max-mb", "0", "--output",
                                                     "{scratch}/t.model"], r"--max-mb 0.0 must be a number > 0"),
    Row("tokenizer-input-not-json", "train_tokenizer", ["--input", "{data}/bad_json.jsonl", "--output",
                                                        "{scratch}/t.model"], r"bad_json.jsonl line 1: not valid JSON"),
]

#!/usr/bin/env python3
"""Train a sentencepiece tokenizer on raw text (the same inputs prepare_data.py reads).

    python scripts/train_tokenizer.py --input 'raw/*.jsonl.zst' --vocab-size 32000 --output tok.model

Byte-fallback BPE that keeps whitespace exactly (decode(encode(text)) == text); ids pad 0, bos 1,
eos 2, unk 3. Samples about --max-mb of text, an equal share from every file.
"""

import argparse
import os
import sys
import time

from maxtrain.data import prepare, tokenizer
from maxtrain.data.errors import DataError
from maxtrain.errors import run_cli


def _check_output(path: str) -> None:
    """--output must be a file path whose directory can be made."""
    if os.path.isdir(path):
        raise DataError(f"--output {path} is a directory; give the .model file's path, e.g. {path}/tok.model")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise DataError(f"--output {path} cannot be written: {parent} is a file, not a directory")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", action="append", required=True, help="glob of .txt/.jsonl/.parquet files; repeatable")
    p.add_argument("--output", required=True, help="where to write the .model file")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    p.add_argument("--txt-documents", default="file", choices=("file", "line", "paragraph"))
    p.add_argument("--max-mb", type=float, default=200.0, help="megabytes of text to sample")
    args = p.parse_args(argv)
    if args.vocab_size < 5:  # pad, bos, eos, unk and the newline symbol, before any learned piece
        raise DataError(f"--vocab-size {args.vocab_size} is too small: the tokenizer needs at least 5 ids "
                        "(pad, bos, eos, unk, newline) plus one per distinct character; e.g. --vocab-size 32000")
    if not (0 < args.max_mb < float("inf")):
        raise DataError(f"--max-mb {args.max_mb} must be a number > 0 (megabytes of text to sample)")
    _check_output(args.output)
    files = prepare.expand_inputs(args.input)
    start = time.time()
    texts = tokenizer.sample_texts(files, int(args.max_mb * 1e6), args.text_field, args.txt_documents)
    try:
        model = tokenizer.train(texts, args.vocab_size)
    except RuntimeError as e:  # sentencepiece reports impossible sizes as RuntimeError
        message = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        if "ocabulary size" not in message:
            raise
        raise DataError(f"--vocab-size {args.vocab_size} does not fit this text: sentencepiece says {message!r}. "
                        "Choose a --vocab-size in the range it names (every distinct character needs an id; more "
                        "pieces than the text supports cannot be learned).") from None
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "wb") as f:
        f.write(model.model_proto)
    print(f"train_tokenizer: {model.vocab_size} pieces from {len(files)} files in {time.time() - start:.1f}s -> "
          f"{args.output} (checksum {model.checksum})", file=sys.stderr)


if __name__ == "__main__":
    run_cli("train_tokenizer", main)

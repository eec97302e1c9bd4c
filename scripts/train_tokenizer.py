#!/usr/bin/env python3
"""Train a tokenizer on raw text (the same inputs prepare_data.py reads).

    python scripts/train_tokenizer.py --input 'raw/*.jsonl.zst' --vocab-size 32000 --output tok.model
    python scripts/train_tokenizer.py --kind hf --input 'raw/*.jsonl.zst' --vocab-size 32000 --output tok/

--kind sentencepiece (the default): byte-fallback BPE that keeps whitespace exactly
(decode(encode(text)) == text); ids pad 0, bos 1, eos 2, unk 3; one .model file.
--kind hf: byte-level BPE with the Hugging Face `tokenizers` library; ids <|pad|> 0,
<|begin_of_text|> 1, <|end_of_text|> 2; a directory with tokenizer.json, tokenizer_config.json and
special_tokens_map.json, which transformers' AutoTokenizer.from_pretrained reads as it is.
Either is used with tokenizer_path=<output> (or prepare_data.py --tokenizer <output>). Samples about
--max-mb of text, an equal share from every file.
"""

import argparse
import os
import sys
import time

from maxtrain import errors, storage
from maxtrain.data import prepare, tokenizer_training
from maxtrain.data.errors import DataError


def main(argv=None):
    p = argparse.ArgumentParser(prog="train_tokenizer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", action="append", required=True, help="glob of .txt/.jsonl/.parquet files; repeatable")
    p.add_argument("--output", required=True,
                   help="the .model file to write (sentencepiece), or the directory to write (hf)")
    p.add_argument("--kind", choices=tokenizer_training.KINDS, default="sentencepiece")
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
    out = args.output
    if args.kind == "hf" and (os.path.isfile(out) or out.endswith((".model", ".json"))):
        raise DataError(f"--kind hf writes a directory (tokenizer.json, tokenizer_config.json, "
                        f"special_tokens_map.json), but --output {out!r} names a file. Give a directory, e.g. "
                        f"--output {os.path.splitext(out)[0]}/")
    if args.kind == "sentencepiece" and os.path.isdir(out):
        raise DataError(f"--output {out!r} is a directory; sentencepiece writes one file: give its name, e.g. "
                        f"--output {os.path.join(out, 'tok.model')} (or use --kind hf to write a directory)")
    storage.check_output(out, args.kind == "sentencepiece", f"--output {out}")  # before the sampling and training
    files = prepare.expand_inputs(args.input)
    start = time.time()
    texts = tokenizer_training.sample_texts(files, int(args.max_mb * 1e6), args.text_field, args.txt_documents)
    tok = tokenizer_training.train(args.kind, texts, args.vocab_size, setting="--vocab-size {}")
    with errors.user_paths("--output"):
        tok.write(out)
    print(f"train_tokenizer: {tok.vocab_size} pieces ({args.kind}) from {len(files)} files in "
          f"{time.time() - start:.1f}s -> {out} (checksum {tok.checksum}); train with tokenizer_path={out} "
          f"vocab_size={tok.vocab_size} (or more)", file=sys.stderr)


if __name__ == "__main__":
    errors.run_cli("train_tokenizer", main)

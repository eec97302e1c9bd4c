"""Sentencepiece tokenization: loading a model, and training one on a corpus.

Ids: 0 = pad, 1 = BOS, 2 = EOS, 3 = unk. Trained models keep all whitespace (identity
normalization, newline as a symbol, byte fallback), so decode(encode(text)) == text for source code.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Iterable

import sentencepiece as spm

from maxtrain.data.errors import DataError

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


class Tokenizer:
    def __init__(self, model_proto: bytes, path: str = "<memory>"):
        self.path = path
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.checksum = hashlib.sha256(model_proto).hexdigest()[:16]

    def __getstate__(self):  # grain worker processes rebuild the processor from the proto
        return {"model_proto": self.model_proto, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["model_proto"], state["path"])

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        if not os.path.isfile(path):
            raise DataError(f"tokenizer_path={path!r} does not exist. Point it at a sentencepiece .model "
                                    "file, or train one with scripts/train_tokenizer.py")
        with open(path, "rb") as f:
            proto = f.read()
        try:
            return cls(proto, path)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError variants
            raise DataError(f"tokenizer_path={path!r} is not a valid sentencepiece model: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def pad_id(self) -> int:
        return max(self.sp.pad_id(), 0)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def train(texts: Iterable[str], vocab_size: int, chunk_chars: int = 2000) -> Tokenizer:
    """Trains a byte-fallback BPE sentencepiece model that preserves whitespace exactly."""

    def chunks():
        for text in texts:
            for i in range(0, len(text), chunk_chars):
                yield text[i:i + chunk_chars]

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=chunks(), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        split_digits=True, byte_fallback=True, user_defined_symbols=["\n"], character_coverage=1.0,
        max_sentence_length=4 * chunk_chars, input_sentence_size=500_000, shuffle_input_sentence=True,
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, num_threads=os.cpu_count() or 1,
        minloglevel=2)
    return Tokenizer(model.getvalue())


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but vocab_size={vocab_size}: "
                         f"token ids would fall outside the embedding. Set vocab_size={tokenizer.vocab_size} or more.")


def sample_texts(files: list[str], max_bytes: int, text_field: str = "text", txt_documents: str = "file"):
    """Documents from every file, about max_bytes in all: each file gives at most an equal share,
    so the tokenizer sees every source, not just the first files."""
    from maxtrain.data import text_files  # pylint: disable=import-outside-toplevel

    share = max(max_bytes // max(len(files), 1), 1)
    for path in files:
        used = 0
        for text in text_files.read_texts(path, text_field, txt_documents):
            if not text.strip():
                continue
            yield text
            used += len(text)
            if used >= share:
                break

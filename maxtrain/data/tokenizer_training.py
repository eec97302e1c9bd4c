"""Training a tokenizer on raw text (scripts/train_tokenizer.py, and the default corpus' tokenizer).

    sentencepiece (the default)   byte-fallback BPE that keeps whitespace exactly (identity normalization,
                                  newline as a symbol), so decode(encode(text)) == text for source code;
                                  ids pad 0, bos 1, eos 2, unk 3; one .model file
    hf                            byte-level BPE with the `tokenizers` library (every byte sequence encodes,
                                  and decodes back exactly); ids <|pad|> 0, <|begin_of_text|> 1,
                                  <|end_of_text|> 2; a directory as Hugging Face repositories have it
                                  (tokenizer.json, tokenizer_config.json, special_tokens_map.json), which
                                  transformers' AutoTokenizer reads as it is
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Iterable

from maxtrain.data import text_files
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data.errors import DataError

KINDS = ("sentencepiece", "hf")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3  # sentencepiece
HF_PAD, HF_BOS, HF_EOS = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"  # ids 0, 1, 2


def train(kind: str, texts: Iterable[str], vocab_size: int, setting: str = "vocab_size={}") -> tokenizer_lib.Tokenizer:
    """The tokenizer; `setting` names vocab_size as the caller's user gives it, in error messages."""
    if kind == "sentencepiece":
        return train_sentencepiece(texts, vocab_size, setting=setting)
    if kind == "hf":
        return train_hf(texts, vocab_size, setting=setting)
    raise DataError(f"unknown tokenizer kind {kind!r}: choose one of {', '.join(KINDS)}")


def train_sentencepiece(texts: Iterable[str], vocab_size: int, chunk_chars: int = 2000,
                        setting: str = "vocab_size={}") -> tokenizer_lib.Tokenizer:
    """A byte-fallback BPE sentencepiece model that preserves whitespace exactly. A vocab_size the text
    cannot fill, or one below its distinct characters, is a DataError naming the sizes that fit, with
    `setting` ("vocab_size={}", "--vocab-size {}") naming the size as the user gave it."""
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    def chunks():
        for text in texts:
            for i in range(0, len(text), chunk_chars):
                yield text[i:i + chunk_chars]

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=chunks(), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            split_digits=True, byte_fallback=True, user_defined_symbols=["\n"], character_coverage=1.0,
            max_sentence_length=4 * chunk_chars, input_sentence_size=500_000, shuffle_input_sentence=True,
            pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, num_threads=os.cpu_count() or 1,
            minloglevel=2)
    except RuntimeError as e:  # sentencepiece reports sizes that do not fit the text as RuntimeError
        error = _size_error(str(e), vocab_size, setting)
        if error is None:
            raise
        raise error from None
    return tokenizer_lib.from_files({tokenizer_lib.SP_MODEL: model.getvalue()}, "<trained>")


def _size_error(message: str, vocab_size: int, setting: str) -> DataError | None:
    """sentencepiece's size errors ("... smaller than required_chars. 10 vs 356", "Vocabulary size too
    high (300000). Please set it to a value <= 66910.") said in the user's terms; None for any other."""
    given = setting.format(vocab_size)
    low = re.search(r"smaller than required_chars\. *\d+ vs (\d+)", message)
    if low:
        need = int(low.group(1))
        return DataError(f"{given} is too small for this text: every distinct character of it, and the special "
                         f"pieces, need an id of their own, {need} in all. Use {setting.format(need)} or more")
    high = re.search(r"Vocabulary size too high .*<= *(\d+)", message)
    if high:
        most = int(high.group(1))
        return DataError(f"{given} is more pieces than sentencepiece can learn from this text (at most {most}: "
                         f"it runs out of merges). Use {setting.format(most)} or less, or train on more text")
    return None


def train_hf(texts: Iterable[str], vocab_size: int, setting: str = "vocab_size={}") -> tokenizer_lib.Tokenizer:
    """A byte-level BPE tokenizer.json with its config files; fewer than vocab_size pieces when the text
    has no more merges to offer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=import-outside-toplevel

    specials = [HF_PAD, HF_BOS, HF_EOS]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise DataError(f"{setting.format(vocab_size)} is too small for a byte-level BPE: its {len(alphabet)} bytes "
                        f"and {len(specials)} special tokens come first. Use "
                        f"{setting.format(len(specials) + len(alphabet))} or more")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # tokenizer(text) in transformers starts with BOS, as Llama 3's does; maxtrain adds it itself.
    tok.post_processor = processors.TemplateProcessing(single=f"{HF_BOS} $A", pair=f"{HF_BOS} $A {HF_BOS} $B",
                                                       special_tokens=[(HF_BOS, 1)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    named = {"bos_token": HF_BOS, "eos_token": HF_EOS, "pad_token": HF_PAD}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(specials)}
    config = {"added_tokens_decoder": added, **named, "clean_up_tokenization_spaces": False,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    files = {tokenizer_lib.TOKENIZER_JSON: tok.to_str(pretty=True).encode(),
             tokenizer_lib.TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
             tokenizer_lib.SPECIAL_TOKENS_MAP: (json.dumps(named, indent=2) + "\n").encode()}
    return tokenizer_lib.from_files(files, "<trained>")


def sample_texts(files: list[str], max_bytes: int, text_field: str = "text", txt_documents: str = "file"):
    """Documents from every file, about max_bytes in all: each file gives at most an equal share,
    so the tokenizer sees every source, not just the first files."""
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

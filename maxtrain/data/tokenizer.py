"""Tokenizers: one interface over sentencepiece models and Hugging Face `tokenizers` files.

    load(path) -> Tokenizer    path: a sentencepiece .model file, a Hugging Face tokenizer.json, or a
                               directory (an HF model directory) with tokenizer.json and/or tokenizer.model,
                               and optionally tokenizer_config.json, special_tokens_map.json,
                               generation_config.json and chat_template.jinja

Every Tokenizer has
    encode(text) -> ids        BOS/EOS never added: see document() and prompt_ids()
    encode_batch(texts)
    decode(ids) -> text        ids the tokenizer lacks (a model vocabulary padded above it) decode to nothing
    piece(id) -> text          one token as it reads in the text ('Ġthe' -> ' the', '<0x0A>' -> newline),
                               for inspect_data and viz; an id the tokenizer lacks shows as '<id N>'
    vocab_size                 1 + the largest id it can emit, added and special tokens included
    bos_id, eos_id, pad_id     None where the tokenizer has none; eos_ids: every id that ends a sequence
    chat_template              the Jinja template (chat_template.jinja, or tokenizer_config.json's), or None
    checksum, path, kind, files
and pickles as the bytes of its files (Grain worker processes receive it).

Which ids are special. A bare sentencepiece .model: its own bos/eos/pad. A tokenizer_config.json
(HF's semantics, as transformers reads it): bos_token / eos_token / pad_token, strings or AddedToken
dicts, null meaning none; special_tokens_map.json fills in keys tokenizer_config.json does not set.
generation_config.json's eos_token_id (an int or a list) gives eos_ids, and eos_id is its first;
tokenizer_config.json's eos_token joins the list when it is not in it. A bare tokenizer.json has no
bos/eos/pad. transformers adds a named special token that the vocabulary lacks as a new token; here
that is an error, as the model has no embedding row for it. decode() is the tokenizer's own decoding
(without transformers' clean_up_tokenization_spaces, which rewrites "a ." as "a."), so
decode(encode(text)) == text for byte-level and whitespace-preserving tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from maxtrain.data.errors import DataError
from maxtrain.errors import ConfigError

SP_MODEL = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
CONFIG_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG, CHAT_TEMPLATE)
ACCEPTS = ("a sentencepiece .model, a Hugging Face tokenizer.json, or a directory holding them (an HF model "
           "directory)")
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def load(path: str, key: str = "tokenizer_path") -> "Tokenizer":
    """The tokenizer at `path`; `key` names the setting in error messages (tokenizer_path, --tokenizer)."""
    where = f"{key}={path!r}" if key.isidentifier() else f"{key} {path!r}"
    full = os.path.expanduser(path)
    if os.path.isdir(full):
        files = _read_directory(full, where)
    elif os.path.isfile(full):
        with open(full, "rb") as f:
            data = f.read()
        files = {TOKENIZER_JSON if data.lstrip()[:1] == b"{" else SP_MODEL: data}
    else:
        raise DataError(f"{where} does not exist. Give {ACCEPTS}, or train one with scripts/train_tokenizer.py")
    return from_files(files, full)


def from_files(files: dict[str, bytes], path: str) -> "Tokenizer":
    """A tokenizer from the contents of its files, by their canonical names (tokenizer.json, ...)."""
    if TOKENIZER_JSON in files:
        return HFTokenizer(files, path)
    return SentencePieceTokenizer(files, path)


def _read_directory(directory: str, where: str) -> dict[str, bytes]:
    names = set(os.listdir(directory))
    main = TOKENIZER_JSON if TOKENIZER_JSON in names else SP_MODEL if SP_MODEL in names else None
    if main is None:
        nested = os.path.join(directory, "tokenizer")  # where prepared data keeps its copy
        hint = f" (is it {nested}?)" if os.path.isdir(nested) else ""
        raise DataError(f"{where} is a directory without tokenizer.json or tokenizer.model{hint}. Give {ACCEPTS}; for "
                        "a Hugging Face model, download its tokenizer files too (tokenizer.json, tokenizer_config.json"
                        ", generation_config.json)")
    files = {}
    for name in (main, *CONFIG_FILES):
        if name in names:
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
    return files


class Tokenizer:
    """What both kinds share: the files, the checksum, the special ids from the config files, pickling."""

    kind = ""

    def __init__(self, files: dict[str, bytes], path: str):
        self.files, self.path = dict(files), path
        self.checksum = _checksum(self.files)
        self.vocab_size = self._size()
        # tokenizer_config.json first, then special_tokens_map.json (older repos; the two agree in practice)
        self._configs = [(TOKENIZER_CONFIG, self._json(TOKENIZER_CONFIG)),
                         (SPECIAL_TOKENS_MAP, self._json(SPECIAL_TOKENS_MAP))]
        self.bos_id = self._special("bos_token")
        self.pad_id = self._special("pad_token")
        eos = self._special("eos_token")
        self._check_listed_tokens()
        generation = self._json(GENERATION_CONFIG).get("eos_token_id")
        eos_ids = [generation] if isinstance(generation, int) else list(generation or [])
        for i in eos_ids:
            if not (isinstance(i, int) and 0 <= i < self.vocab_size):
                raise DataError(f"{self._where(GENERATION_CONFIG)}: eos_token_id {i!r} is not a token id of this "
                                f"tokenizer (it has {self.vocab_size} pieces). Use the generation_config.json that came "
                                "with this tokenizer, or delete the file")
        self.eos_ids = tuple(eos_ids + ([eos] if eos is not None and eos not in eos_ids else []))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.chat_template = self._chat_template(self._configs[0][1])

    def __reduce__(self):  # Grain worker processes rebuild the tokenizer from its files
        return from_files, (self.files, self.path)

    def __repr__(self):
        return (f"{type(self).__name__}({self.path!r}, {self.vocab_size} pieces, bos {self.bos_id}, eos {self.eos_id}, "
                f"pad {self.pad_id}, checksum {self.checksum})")

    # -- implemented by each kind ------------------------------------------------------------
    def _size(self) -> int:
        raise NotImplementedError

    def _default_special(self, key: str) -> int | None:
        """The id of bos_token/eos_token/pad_token when no config file names one."""
        raise NotImplementedError

    def _token_id(self, content: str) -> int | None:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _piece(self, token_id: int) -> str | None:
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def decode(self, ids) -> str:
        """Text of `ids`; ids outside the tokenizer (a padded model vocabulary) are left out."""
        return self._decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def piece(self, token_id: int) -> str:
        """The text one token stands for, for display; '<id N>' for an id the tokenizer does not have."""
        token_id = int(token_id)
        text = self._piece(token_id) if 0 <= token_id < self.vocab_size else None
        return f"<id {token_id}>" if text is None else text

    def piece_id(self, text: str) -> int | None:
        """The id of the token that `text` is as one piece (an added or special token: <|image|>), or None."""
        return self._token_id(text)

    def write(self, dest: str) -> None:
        """Writes a copy that load(dest) reads back with the same checksum: a single sentencepiece model as
        the file `dest`, anything else as the directory `dest` (its other tokenizer files removed)."""
        if self.single_file:
            _write_atomic(dest, self.files[SP_MODEL])
            return
        os.makedirs(dest, exist_ok=True)
        for name in (TOKENIZER_JSON, SP_MODEL, *CONFIG_FILES):
            target = os.path.join(dest, name)
            if name in self.files:
                _write_atomic(target, self.files[name])
            elif os.path.exists(target):
                os.remove(target)  # a stale file would change what the copy means

    @property
    def single_file(self) -> bool:
        return list(self.files) == [SP_MODEL]

    def _where(self, name: str) -> str:
        """The file `name` as the user knows it: inside the directory, or the path itself."""
        return os.path.join(self.path, name) if os.path.isdir(self.path) else self.path

    def _json(self, name: str) -> dict:
        if name not in self.files:
            return {}
        try:
            data = json.loads(self.files[name].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{self._where(name)} is not valid JSON ({e}). Download it again from the model's "
                            "repository, or delete it") from None
        if not isinstance(data, dict):
            raise DataError(f"{self._where(name)} holds a {type(data).__name__}, not a JSON object. Download it again "
                            "from the model's repository, or delete it")
        return data

    def _special(self, key: str) -> int | None:
        """The id of bos_token/eos_token/pad_token: from the first config file that sets it, else the default."""
        for name, config in self._configs:
            if key in config:
                return self._named_id(config[key], key, name)
        return self._default_special(key)

    def _check_listed_tokens(self) -> None:
        """Every other special or added token the config files list must be in the vocabulary too."""
        for name, config in self._configs:
            for key in ("additional_special_tokens", "extra_special_tokens", "added_tokens_decoder"):
                listed = config.get(key) or []
                for token in listed.values() if isinstance(listed, dict) else listed:
                    self._named_id(token, key, name)

    def _named_id(self, value, key: str, name: str) -> int | None:
        """The id of a token a config file names (a string, an AddedToken dict, or null for none)."""
        content = value.get("content") if isinstance(value, dict) else value
        if content is None:
            return None
        token_id = self._token_id(content) if isinstance(content, str) else None
        if token_id is None:
            main = TOKENIZER_JSON if TOKENIZER_JSON in self.files else SP_MODEL
            raise DataError(f"{self._where(name)}: {key} names {content!r}, which is not in the vocabulary of "
                            f"{self._where(main)} (transformers would add it as a new token, which the model has no "
                            f"embedding for). Change it to one of the tokenizer's tokens (or null), or use the config "
                            "files that came with this tokenizer")
        return token_id

    def _chat_template(self, config: dict) -> str | None:
        if CHAT_TEMPLATE in self.files:
            return self.files[CHAT_TEMPLATE].decode("utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        return template if isinstance(template, str) else None


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, files: dict[str, bytes], path: str):
        import sentencepiece as spm  # pylint: disable=import-outside-toplevel

        proto = files[SP_MODEL]
        where = os.path.join(path, SP_MODEL) if os.path.isdir(path) else path
        if _looks_like_tiktoken(proto):
            raise DataError(f"{where} is a tiktoken BPE file (as in Llama 3's original/ directory), not a sentencepiece "
                            "model. Use the Hugging Face tokenizer.json (or the model directory holding it) instead")
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:  # pylint: disable=broad-except  (sentencepiece raises RuntimeError/OSError variants)
            raise DataError(f"{where} is not a sentencepiece model ({str(e).strip().splitlines()[-1]}). Give {ACCEPTS}, "
                            "or train one with scripts/train_tokenizer.py") from None
        super().__init__(files, path)

    def _size(self) -> int:
        return self.sp.get_piece_size()

    def _default_special(self, key: str) -> int | None:
        token_id = {"bos_token": self.sp.bos_id, "eos_token": self.sp.eos_id, "pad_token": self.sp.pad_id}[key]()
        return token_id if token_id >= 0 else None

    def _token_id(self, content: str) -> int | None:
        token_id = self.sp.piece_to_id(content)
        return token_id if self.sp.id_to_piece(token_id) == content else None  # unknown pieces map to unk

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(list(texts))

    def _decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def _piece(self, token_id: int) -> str:
        piece = self.sp.id_to_piece(token_id)
        if self.sp.is_control(token_id) or self.sp.is_unknown(token_id):
            return piece
        byte = _BYTE_PIECE.match(piece) if self.sp.is_byte(token_id) else None
        return _readable(bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode())


class HFTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, files: dict[str, bytes], path: str):
        from tokenizers import Tokenizer as Backend  # pylint: disable=import-outside-toplevel

        where = os.path.join(path, TOKENIZER_JSON) if os.path.isdir(path) else path
        fix = "Download it again from the model's repository, or make one with scripts/train_tokenizer.py --kind hf"
        try:
            text = files[TOKENIZER_JSON].decode("utf-8")
            spec = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{where} is not valid JSON ({e}): a damaged or truncated tokenizer.json. {fix}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise DataError(f"{where} has no 'model' section, so it is not a tokenizer.json (tokenizer_config.json and "
                            f"the like only describe one). Give {ACCEPTS}")
        try:
            self._tok = Backend.from_str(text)
        except Exception as e:  # pylint: disable=broad-except  (the Rust side raises a bare Exception)
            import tokenizers  # pylint: disable=import-outside-toplevel

            raise DataError(f"{where} cannot be read by tokenizers {tokenizers.__version__} ({e}). If the tokenizer is "
                            f"newer than the library, pip install -U tokenizers; otherwise the file is damaged. {fix}") \
                from None
        self._tok.no_padding()  # a tokenizer.json may ask for padding or truncation: documents stay whole here
        self._tok.no_truncation()
        self._byte_level, self._space, self._byte_fallback = _decoder_features(spec.get("decoder"))
        self._added = set(self._tok.get_added_tokens_decoder())
        super().__init__(files, path)

    def _size(self) -> int:
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def _default_special(self, key: str) -> None:
        return None  # transformers names no special tokens without a config file

    def _token_id(self, content: str) -> int | None:
        return self._tok.token_to_id(content)

    def encode(self, text: str) -> list[int]:  # the batch call skips offsets: 1.4x faster than encode()
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def _piece(self, token_id: int) -> str | None:
        token = self._tok.id_to_token(token_id)
        if token is None or token_id in self._added:
            return token  # added and special tokens read as written
        if self._byte_level:
            return _readable(bytes(_UNICODE_TO_BYTE.get(c, 0x3F) for c in token))  # '?' for what is not a byte
        byte = _BYTE_PIECE.match(token) if self._byte_fallback else None
        if byte:
            return _readable(bytes([int(byte.group(1), 16)]))
        return _readable((token.replace(self._space, " ") if self._space else token).encode())


# --------------------------------------------------------------------------------------------
# Callers' helpers
# --------------------------------------------------------------------------------------------


def document(tok: Tokenizer, ids: list[int]) -> list[int]:
    """ids as one training document: [bos, ids..., eos], leaving out what the tokenizer does not have."""
    return ([] if tok.bos_id is None else [tok.bos_id]) + list(ids) + ([] if tok.eos_id is None else [tok.eos_id])


def prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    """A prompt as the model saw documents start: [bos, tokens of text...]."""
    return ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(text)


def checked_prompt_ids(tok: Tokenizer, text: str, key: str = "prompt", max_length: int | None = None,
                       length_key: str = "max_target_length") -> list[int]:
    """prompt_ids, or a ConfigError naming `key` and the fix: when the text gives no tokens of its own (empty,
    or white space this tokenizer drops: a BOS alone is no prompt), or when the prompt (BOS included) is
    longer than max_length (`length_key`, the setting that bounds it)."""
    tokens = tok.encode(text)
    if not tokens:
        what = "is empty" if not text else f"gives no tokens with the tokenizer {tok.path}"
        raise ConfigError(f"{key}={text!r} {what}: there is nothing to continue; give a prompt with some text, e.g. "
                          f"{key}='def main('")
    ids = ([] if tok.bos_id is None else [tok.bos_id]) + tokens
    if max_length is not None and len(ids) > max_length:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ConfigError(f"{key}={shown!r} is {len(ids)} tokens, more than {length_key}={max_length} (the longest "
                          f"sequence the model is run on); shorten the prompt or raise {length_key}")
    return ids


def check_vocab(tok: Tokenizer, vocab_size: int) -> None:
    """Refuses a tokenizer whose ids reach past the model's embedding (fewer pieces are fine)."""
    if tok.vocab_size > vocab_size:
        padded = -(-tok.vocab_size // 128) * 128
        raise DataError(f"the tokenizer {tok.path} has {tok.vocab_size} pieces but vocab_size={vocab_size}: its token "
                        f"ids would fall outside the model's embedding. Set vocab_size={tok.vocab_size} or more (e.g. "
                        f"{padded}, a multiple of 128), or use the tokenizer the model was made with.")


def warn_if_no_eos(tok: Tokenizer, log=print) -> None:
    if tok.eos_id is None:
        log(f"warning: the tokenizer {tok.path} has no end-of-sequence token, so documents end without one and "
            "decoding does not stop early. For a Hugging Face tokenizer, point tokenizer_path at the model directory "
            "(its tokenizer_config.json names eos_token)")


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _checksum(files: dict[str, bytes]) -> str:
    if list(files) == [SP_MODEL]:  # a bare sentencepiece model: the hash of its bytes, as before
        return hashlib.sha256(files[SP_MODEL]).hexdigest()[:16]
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{len(files[name])}\0".encode() + files[name])
    return digest.hexdigest()[:16]


def _write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _looks_like_tiktoken(data: bytes) -> bool:
    """tiktoken files are lines of '<base64 token> <rank>'."""
    first = data[:200].split(b"\n", 1)[0].split(b" ")
    return len(first) == 2 and first[1].strip().isdigit() and re.fullmatch(rb"[A-Za-z0-9+/=]+", first[0]) is not None


def _decoder_features(decoder) -> tuple[bool, str | None, bool]:
    """(byte-level, the character that stands for a space, byte fallback) from a tokenizer.json decoder."""
    byte_level, space, byte_fallback = False, None, False
    stack = [decoder]
    while stack:
        d = stack.pop()
        if not isinstance(d, dict):
            continue
        kind = d.get("type")
        if kind == "Sequence":
            stack.extend(d.get("decoders") or [])
        elif kind == "ByteLevel":
            byte_level = True
        elif kind == "Metaspace":
            space = d.get("replacement", "\u2581")
        elif kind == "Replace" and d.get("content") == " " and isinstance(d.get("pattern"), dict):
            space = d["pattern"].get("String", space)
        elif kind == "ByteFallback":
            byte_fallback = True
    return byte_level, space, byte_fallback


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other 68
    bytes for the characters from U+0100 on, in byte order ('Ġ' is the space, 'Ċ' the newline)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def _readable(data: bytes) -> str:
    """UTF-8 text; bytes that are not whole characters, and control characters other than tab and newline,
    as <0xNN>."""
    out = []
    for c in data.decode("utf-8", "surrogateescape"):
        code = ord(c)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"<0x{code - 0xDC00:02X}>")
        elif (code < 32 and c not in "\t\n") or code == 127:
            out.append(f"<0x{code:02X}>")
        else:
            out.append(c)
    return "".join(out)

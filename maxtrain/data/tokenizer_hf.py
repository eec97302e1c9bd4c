"""A maxtrain tokenizer as the files of a Hugging Face tokenizer directory that transformers'
AutoTokenizer reads to exactly maxtrain's ids, BOS included (scripts/convert_hf.py export).

    hf_files(tok) -> ({file name: bytes}, notes)

A sentencepiece model becomes a tokenizer.json built with the `tokenizers` library from the model
itself: its pieces and scores (BPE merges ranked by the merged piece's score, or the unigram
vocabulary), byte fallback, its user-defined symbols (maxtrain's newline) as added tokens matched
after normalization as sentencepiece matches them, the dummy prefix on the whole text and spaces as
U+2581. The original tokenizer.model goes with it. transformers' own conversion of a sentencepiece
model (LlamaTokenizer) differs from sentencepiece on text that starts with a space or a newline, so
it is not relied on. A Hugging Face tokenizer keeps its files; only a post-processor that does not
add BOS as maxtrain does (maxtrain starts every document and prompt with BOS when the tokenizer has
one, and never appends EOS to a prompt) is replaced.

tokenizer_config.json names bos/eos/unk/pad and says add_bos_token / add_eos_token; before anything
is written, the tokenizer.json is checked with `tokenizers` against maxtrain's own ids on PROBES.
"""

from __future__ import annotations

import json

from maxtrain.data import tokenizer as tokenizer_lib

# Spaces, tabs, newlines (leading, trailing, repeated), digits, accents, CJK, an emoji, carriage returns.
PROBES = ("", "a", " hello", "  two leading spaces", "\nstarts with a newline", "ends with a space ",
          "def f(x):\n    return x + 12345\n\n\n", "x=1.5e-3;  # comment\r\n\tindented\twith tabs",
          "ünïcödé Straße 日本語のテキスト 🙂 emoji", "a  b   c    d     e", "0123456789 99 3.14159",
          "line one\n\nline two\n  indented\n")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # sentencepiece's piece types
_SPACE = "\u2581"


class NotConvertible(ValueError):
    """A sentencepiece model whose tokenizer.json would not give sentencepiece's ids; the message says where."""


def hf_files(tok: tokenizer_lib.Tokenizer) -> tuple[dict[str, bytes], list[str]]:
    """The files of a Hugging Face tokenizer directory that tokenizes as `tok`, and notes for the user."""
    notes: list[str] = []
    if tok.kind == "sentencepiece":
        files = {tokenizer_lib.SP_MODEL: tok.files[tokenizer_lib.SP_MODEL]}
        try:
            spec = sentencepiece_json(tok)
        except NotConvertible as e:  # tokenizer.model alone: transformers converts it its own way
            notes.append(f"{e}; wrote tokenizer.model only, which transformers converts with its LlamaTokenizer (ids "
                         "may differ from maxtrain's on some texts)")
            spec = None
        if spec is not None:
            files[tokenizer_lib.TOKENIZER_JSON] = _json_bytes(spec)
        config = {**_json(tok, tokenizer_lib.TOKENIZER_CONFIG),
                  "tokenizer_class": "PreTrainedTokenizerFast" if spec is not None else "LlamaTokenizer"}
        for key in ("legacy", "sp_model_kwargs", "add_prefix_space"):
            config.pop(key, None)  # settings of transformers' own sentencepiece conversion
        if spec is None:
            config["legacy"] = False
        config["split_special_tokens"] = True  # sentencepiece reads "<s>" in a text as characters, never as BOS
    else:
        files = {tokenizer_lib.TOKENIZER_JSON: tok.files[tokenizer_lib.TOKENIZER_JSON]}
        spec = json.loads(tok.files[tokenizer_lib.TOKENIZER_JSON])
        if _encode(spec, PROBES[1], special=True) != tokenizer_lib.prompt_ids(tok, PROBES[1]):
            spec["post_processor"] = _post_processor(tok)
            files[tokenizer_lib.TOKENIZER_JSON] = _json_bytes(spec)
            notes.append("tokenizer.json's post-processor did not add BOS as maxtrain does; the export's adds "
                         + ("nothing" if tok.bos_id is None else repr(tok.piece(tok.bos_id))))
        config = _json(tok, tokenizer_lib.TOKENIZER_CONFIG) or {"tokenizer_class": "PreTrainedTokenizerFast"}
    # A name the config files give stays (maxtrain read its ids from them); a sentencepiece model's own fill the rest.
    named = {"bos_token": tok.bos_id, "eos_token": tok.eos_id, "pad_token": tok.pad_id}
    if tok.kind == "sentencepiece":
        named["unk_token"] = tok.sp.unk_id() if tok.sp.unk_id() >= 0 else None
    for key, token_id in named.items():
        if key not in config and token_id is not None:
            config[key] = tok.sp.id_to_piece(token_id) if tok.kind == "sentencepiece" else tok.piece(token_id)
    config.update(add_bos_token=tok.bos_id is not None, add_eos_token=False, clean_up_tokenization_spaces=False)
    files[tokenizer_lib.TOKENIZER_CONFIG] = _json_bytes(config)
    if tok.chat_template is not None and tokenizer_lib.CHAT_TEMPLATE in tok.files:
        files[tokenizer_lib.CHAT_TEMPLATE] = tok.files[tokenizer_lib.CHAT_TEMPLATE]
    if spec is not None:
        check_same_ids(tok, spec)
    return files, notes


def check_same_ids(tok: tokenizer_lib.Tokenizer, spec: dict, texts=PROBES) -> None:
    """Raises ValueError naming the first text on which `spec` (a tokenizer.json, with its post-processor)
    gives other ids than maxtrain's prompt_ids."""
    for text in texts:
        ours, theirs = tokenizer_lib.prompt_ids(tok, text), _encode(spec, text, special=True)
        if ours != theirs:
            raise ValueError(f"the exported tokenizer.json gives {theirs[:16]} for {text!r}, maxtrain {ours[:16]}")


# --------------------------------------------------------------------------------------------
# sentencepiece -> tokenizer.json
# --------------------------------------------------------------------------------------------


def sentencepiece_json(tok) -> dict:
    """The tokenizer.json of a sentencepiece model (BPE or unigram), with maxtrain's BOS post-processor.
    Raises NotConvertible when it would not give sentencepiece's ids on PROBES."""
    from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel  (needs protobuf)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers  # pylint: disable=import-outside-toplevel

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.files[tokenizer_lib.SP_MODEL])
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    byte_fallback = any(kind == _BYTE for _, _, kind in pieces)
    unk = tok.sp.unk_id() if tok.sp.unk_id() >= 0 else None
    model_type = proto.trainer_spec.model_type  # 1 unigram, 2 BPE
    # A user-defined symbol (maxtrain's newline) is one piece that never merges: a character of the vocabulary
    # that no merge names does the same. An added token would not: the dummy prefix would follow it too.
    longer = [piece for piece, _, kind in pieces if kind == _USER_DEFINED and len(piece) > 1]
    if longer or (model_type == 1 and any(kind == _USER_DEFINED for _, _, kind in pieces)):
        raise NotConvertible(f"the sentencepiece model has user-defined symbols {longer[:4]} that a tokenizer.json "
                             "cannot match as sentencepiece does")
    if model_type == 2:
        model = models.BPE(vocab=vocab, merges=_merges(pieces), unk_token=None if unk is None else pieces[unk][0],
                           byte_fallback=byte_fallback, fuse_unk=True)
    elif model_type == 1:
        model = models.Unigram([(piece, score) for piece, score, _ in pieces], unk_id=unk, byte_fallback=byte_fallback)
    else:
        raise NotConvertible(f"the sentencepiece model is of type {model_type} (neither BPE nor unigram)")
    backend = Tokenizer(model)
    spec = proto.normalizer_spec
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(_SPACE))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", _SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []))
    # Control and unknown pieces are special tokens, as transformers makes them anyway from tokenizer_config.json.
    backend.add_special_tokens([AddedToken(piece, special=True, normalized=False)
                                for piece, _, kind in pieces if kind in (_CONTROL, _UNKNOWN)])
    out = json.loads(backend.to_str())
    out["post_processor"] = _post_processor(tok)
    for text in PROBES:
        ours, theirs = tok.encode(text), _encode(out, text, special=False)
        if ours != theirs:
            raise NotConvertible(f"the tokenizer.json made from {tok.path} gives {theirs[:16]} for {text!r}, "
                                 f"sentencepiece {ours[:16]}")
    return out


def _merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """Every (left, right) of normal pieces whose concatenation is a normal piece, in sentencepiece's order:
    the merged piece's score, highest first (its id, then the parts' ids, break ties)."""
    ids = {piece: i for i, (piece, _, kind) in enumerate(pieces) if kind == _NORMAL}
    ranked = []
    for piece, score, kind in pieces:
        if kind != _NORMAL:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in ids and right in ids:
                ranked.append((-score, ids[piece], ids[left], ids[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _post_processor(tok) -> dict | None:
    """BOS before every text when maxtrain adds it (tokenizer_lib.prompt_ids), nothing otherwise."""
    if tok.bos_id is None:
        return None
    bos = tok.piece(tok.bos_id)
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}}


def _encode(spec: dict, text: str, special: bool) -> list[int]:
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

    backend = Tokenizer.from_str(json.dumps(spec))
    backend.no_padding()
    backend.no_truncation()
    return backend.encode(text, add_special_tokens=special).ids


def _json(tok, name: str) -> dict:
    return json.loads(tok.files[name]) if name in tok.files else {}


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

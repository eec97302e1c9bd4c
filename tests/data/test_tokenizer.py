"""Tokenizers: sentencepiece and Hugging Face behind one interface, checked against transformers' AutoTokenizer.

The Hugging Face tokenizers are built here in the formats real repositories use (no downloads): a byte-level
BPE from scripts/train_tokenizer.py --kind hf, a Llama-3-style one (its split pattern, special tokens after
the vocabulary, generation_config.json with several eos ids, a chat template), a Qwen2-style one written by
transformers' own Qwen2Tokenizer.save_pretrained, and a sentencepiece model converted by transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys

import data_helpers as h
import pytest

from maxtrain.config import with_overrides
from maxtrain.data import DataError
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data import tokenizer_training

CORPUS = h.texts(300, "k") + [
    "def main(argv):\n    for i in range(10):\n\t\tprint(f'{i:>4}')  # comment\n    return 0\n",
    "Unicode: héllo wörld, naïve café, Ελληνικά, русский, 日本語, 한국어, العربية, emoji 🎉 and more 3.14159",
] * 20
TEXTS = [
    "Hello, world!",
    "héllo wörld — naïve café; Ελληνικά, русский, 日本語の文章, 한국어, العربية",
    "emoji 🎉👩‍👩‍👧‍👦, combining e\u0301, zero\u200bwidth, a lone surrogate-free 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n\tif x:\n        return x ** 2  # square\n\n\nclass A: pass\r\n",
    "    leading spaces", "trailing spaces   ", "   \n\n\t \t  \n", "",
    "numbers 1234567 3.14159 0x1F 1e-9 2024-01-31",
    "doc k-1: alpha beta gamma",
]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] }}<|eot_id|>{% endfor %}")


def _write(directory, files: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(content if isinstance(content, str) else json.dumps(content, indent=2))
    return str(directory)


# --------------------------------------------------------------------------------------------
# Tokenizers in real formats
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> str:
    """scripts/train_tokenizer.py --kind hf: a directory as an HF user knows it."""
    directory = tmp_path_factory.mktemp("byte_level")
    h.write_jsonl(str(directory / "raw.jsonl"), CORPUS)
    out = directory / "tok"
    result = subprocess.run([sys.executable, os.path.join(h.REPO, "scripts", "train_tokenizer.py"), "--kind", "hf",
                             "--input", str(directory / "raw.jsonl"), "--output", str(out), "--vocab-size", "400"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert f"-> {out}" in result.stderr and "tokenizer_path=" in result.stderr
    assert sorted(os.listdir(out)) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    return str(out)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> str:
    """Llama 3's layout: its split pattern, ignore_merges, 11 special tokens after the vocabulary, BOS added by
    the post-processor, no pad, eos_token <|eot_id|>, generation_config eos [end_of_text, eom, eot]."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    n = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", n)])])
    added = {str(n + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": True} for i, s in enumerate(LLAMA3_SPECIALS)}
    config = {"added_tokens_decoder": added, "bos_token": "<|begin_of_text|>", "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    generation = {"bos_token_id": n, "do_sample": True, "eos_token_id": [n + 1, n + 8, n + 9], "temperature": 0.6,
                  "top_p": 0.9, "transformers_version": "4.45.0"}
    return _write(tmp_path_factory.mktemp("llama3"), {"tokenizer.json": tok.to_str(), "tokenizer_config.json": config,
                                                      "generation_config.json": generation})


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    """Written by transformers' own Qwen2Tokenizer (its NFC normalizer and split pattern), no BOS."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("built with transformers 5's Qwen2Tokenizer(vocab=..., merges=...)")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    qwen = transformers.Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
                                       bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       extra_special_tokens=["<|im_start|>"])
    directory = tmp_path_factory.mktemp("qwen2")
    qwen.save_pretrained(directory)
    _write(directory, {"generation_config.json": {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}})
    return str(directory)


@pytest.fixture(scope="module")
def sentencepiece_converted(tmp_path_factory) -> str:
    """A sentencepiece model (tokenizer.model + tokenizer_config.json, as Llama 2 repos have it) converted to a
    tokenizer.json by transformers (offline: sentencepiece and protobuf only)."""
    transformers = pytest.importorskip("transformers")
    source = tmp_path_factory.mktemp("sp_source")
    tokenizer_training.train_sentencepiece(CORPUS, 400).write(str(source / "tokenizer.model"))
    _write(source, {"tokenizer_config.json": {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                              "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}})
    converted = tmp_path_factory.mktemp("sp_converted")
    transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(converted)
    assert os.path.isfile(converted / "tokenizer.json")
    return str(converted)


# --------------------------------------------------------------------------------------------
# Against transformers
# --------------------------------------------------------------------------------------------


def _specials_in_text(tok) -> list[str]:
    """Texts with the tokenizer's own special-token strings inside (matched as tokens, as transformers does)."""
    names = [tok.piece(i) for i in {tok.bos_id, tok.eos_id, tok.pad_id, *tok.eos_ids} if i is not None]
    return [f"a{names[0]}b {names[-1]} c{''.join(names)}", f"{names[0]}\n{names[0]}  {names[-1]}"]


@pytest.mark.parametrize("name", ["byte_level", "llama3", "qwen2", "sentencepiece_converted"])
def test_same_ids_and_text_as_transformers(name, request):
    transformers = pytest.importorskip("transformers")
    path = request.getfixturevalue(name)
    ours, theirs = tokenizer_lib.load(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.kind == "huggingface"
    assert ours.vocab_size == len(theirs)
    assert (ours.bos_id, ours.pad_id) == (theirs.bos_token_id, theirs.pad_token_id)
    assert theirs.eos_token_id in ours.eos_ids
    texts = TEXTS + _specials_in_text(ours)
    expected = [theirs.encode(t, add_special_tokens=False) for t in texts]
    assert [ours.encode(t) for t in texts] == expected
    assert ours.encode_batch(texts) == expected
    for ids in expected:
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert any(ours.bos_id in ids or ours.eos_id in ids for ids in expected)  # special strings became special ids


def test_llama3_special_ids_and_chat_template(llama3):
    tok = tokenizer_lib.load(llama3)
    n = tok.vocab_size - len(LLAMA3_SPECIALS)
    assert tok.bos_id == n and tok.pad_id is None
    assert tok.eos_ids == (n + 1, n + 8, n + 9) and tok.eos_id == n + 1  # generation_config's order, eot included
    assert tok.chat_template == CHAT_TEMPLATE
    assert [tok.piece(n + i) for i in range(len(LLAMA3_SPECIALS))] == LLAMA3_SPECIALS
    assert tok.encode("<|eot_id|>") == [n + 9]


def test_qwen2_has_no_bos(qwen2):
    tok = tokenizer_lib.load(qwen2)
    assert tok.bos_id is None and tok.pad_id == 0 and tok.eos_ids == (2, 0)
    assert tokenizer_lib.document(tok, [7, 8]) == [7, 8, 2]
    assert tokenizer_lib.prompt_ids(tok, "x") == tok.encode("x")


def test_random_text_matches_transformers_and_round_trips(llama3):
    """Property test: any unicode text (control characters, surrogate-free planes) gets transformers' ids and
    decodes back to itself."""
    transformers = pytest.importorskip("transformers")
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    ours, theirs = tokenizer_lib.load(llama3), transformers.AutoTokenizer.from_pretrained(llama3)
    alphabet = st.characters(blacklist_categories=("Cs",))
    pieces = st.sampled_from(["<|eot_id|>", "<|begin_of_text|>", " ", "\n", "\t", "  ", "ab", "12345"])

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.one_of(st.text(alphabet, max_size=12), pieces), max_size=8).map("".join))
    def check(text):
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text

    check()


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory) -> str:
    return h.tokenizer_path(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory) -> str:
    return h.tokenizer_path(tmp_path_factory, kind="hf")


def test_load_picks_the_kind_by_what_the_path_is(sp_path, hf_path, tmp_path):
    assert tokenizer_lib.load(sp_path).kind == "sentencepiece"
    assert tokenizer_lib.load(hf_path).kind == "huggingface"
    renamed = tmp_path / "any-name.json"  # a tokenizer.json alone, by its content
    renamed.write_bytes(open(os.path.join(hf_path, "tokenizer.json"), "rb").read())
    bare = tokenizer_lib.load(str(renamed))
    assert bare.kind == "huggingface" and (bare.bos_id, bare.eos_id, bare.pad_id) == (None, None, None)
    both = tmp_path / "both"  # tokenizer.json is preferred over tokenizer.model, as transformers does
    _write(both, {})
    for name in os.listdir(hf_path):
        (both / name).write_bytes(open(os.path.join(hf_path, name), "rb").read())
    (both / "tokenizer.model").write_bytes(open(sp_path, "rb").read())
    assert tokenizer_lib.load(str(both)).checksum == tokenizer_lib.load(hf_path).checksum


def test_sentencepiece_directory_reads_its_config(sp_path, tmp_path):
    directory = tmp_path / "sp"
    _write(directory, {"tokenizer_config.json": {"bos_token": {"__type": "AddedToken", "content": "</s>"},
                                                 "eos_token": "<s>", "pad_token": None}})
    (directory / "tokenizer.model").write_bytes(open(sp_path, "rb").read())
    tok = tokenizer_lib.load(str(directory))
    assert tok.kind == "sentencepiece" and (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, None)
    plain = tokenizer_lib.load(sp_path)
    assert (plain.bos_id, plain.eos_id, plain.pad_id) == (1, 2, 0)
    assert tok.encode("alpha beta") == plain.encode("alpha beta") and tok.checksum != plain.checksum


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_encode_decode_round_trip_and_no_bos_eos_added(kind, tmp_path_factory):
    tok = tokenizer_lib.load(h.tokenizer_path(tmp_path_factory, kind=kind))
    text = "doc x-1: alpha  beta\n\tgamma ünïcode 🎉"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text and tok.encode_batch([text, "alpha"]) == [ids, tok.encode("alpha")]
    assert tokenizer_lib.document(tok, ids) == [tok.bos_id, *ids, tok.eos_id]
    assert tokenizer_lib.prompt_ids(tok, text) == [tok.bos_id, *ids]


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_ids_past_the_tokenizer_decode_to_nothing(kind, tmp_path_factory):
    """A model vocabulary padded above the tokenizer's can emit ids the tokenizer lacks."""
    tok = tokenizer_lib.load(h.tokenizer_path(tmp_path_factory, kind=kind))
    ids = tok.encode("alpha beta")
    padded = [tok.vocab_size, *ids[:2], tok.vocab_size + 100, -1, *ids[2:], 10 ** 6]
    assert tok.decode(padded) == tok.decode(ids) == "alpha beta"
    assert tok.piece(tok.vocab_size) == f"<id {tok.vocab_size}>" and tok.piece(-3) == "<id -3>"


def test_piece_shows_tokens_as_they_read(sp_path, hf_path, sentencepiece_converted):
    hf = tokenizer_lib.load(hf_path)
    assert [hf.piece(i) for i in (0, 1, 2)] == ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"]
    space, newline = hf.encode(" ")[0], hf.encode("\n")[0]
    assert hf._tok.id_to_token(space) == "Ġ" and hf.piece(space) == " "  # pylint: disable=protected-access
    assert hf._tok.id_to_token(newline) == "Ċ" and hf.piece(newline) == "\n"  # pylint: disable=protected-access
    assert "".join(hf.piece(i) for i in hf.encode("doc alpha beta")) == "doc alpha beta"
    euro = hf.encode("€")  # three bytes, three tokens: none is a character on its own
    assert [hf.piece(i) for i in euro] == ["<0xE2>", "<0x82>", "<0xAC>"]
    assert hf.piece(hf.encode("\r")[0]) == "<0x0D>"  # control characters are shown, not printed

    sp = tokenizer_lib.load(sp_path)
    assert [sp.piece(i) for i in (0, 1, 2, 3)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert "".join(sp.piece(i) for i in sp.encode(" alpha\n\tbeta")).endswith(" alpha\n\tbeta")
    assert [sp.piece(i) for i in sp.encode("€")][-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]  # after the dummy prefix

    converted = tokenizer_lib.load(sentencepiece_converted)  # Metaspace and byte fallback in a tokenizer.json
    assert "".join(converted.piece(i) for i in converted.encode("alpha\n\tbeta")) == " alpha\n\tbeta"
    assert [converted.piece(i) for i in converted.encode("€")][-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_pickles_and_writes_a_copy_with_the_same_checksum(kind, tmp_path_factory, tmp_path):
    path = h.tokenizer_path(tmp_path_factory, kind=kind)
    tok = tokenizer_lib.load(path)
    again = pickle.loads(pickle.dumps(tok))
    assert type(again) is type(tok) and again.checksum == tok.checksum and again.path == tok.path
    assert again.encode_batch(TEXTS) == tok.encode_batch(TEXTS) and again.eos_ids == tok.eos_ids
    copy = str(tmp_path / ("copy.model" if tok.single_file else "copy"))
    tok.write(copy)
    assert tokenizer_lib.load(copy).checksum == tok.checksum == tokenizer_lib.load(path).checksum
    if kind == "sentencepiece":  # a bare model keeps the checksum it always had (prepared data stays valid)
        assert tok.checksum == hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]
    else:  # the config files are part of it, and a stale one is removed from a copy
        (tmp_path / "copy" / "generation_config.json").write_text('{"eos_token_id": 1}')
        changed = tokenizer_lib.load(copy)
        assert changed.checksum != tok.checksum and changed.eos_ids == (1, 2)
        tok.write(copy)
        assert tokenizer_lib.load(copy).checksum == tok.checksum


def test_special_tokens_from_each_config_file(hf_path, tmp_path):
    directory = tmp_path / "d"
    _write(directory, {"tokenizer.json": open(os.path.join(hf_path, "tokenizer.json")).read(),
                       "special_tokens_map.json": {"bos_token": "<|end_of_text|>", "pad_token": "<|begin_of_text|>",
                                                   "eos_token": {"content": "<|pad|>", "lstrip": False}},
                       "tokenizer_config.json": {"eos_token": "<|end_of_text|>", "pad_token": None,
                                                 "chat_template": [{"name": "tool_use", "template": "T"},
                                                                   {"name": "default", "template": "D"}]},
                       "generation_config.json": {"eos_token_id": 0}})
    tok = tokenizer_lib.load(str(directory))
    # tokenizer_config.json first; special_tokens_map.json only for what it does not set; null means none
    assert (tok.bos_id, tok.pad_id) == (2, None)
    assert tok.eos_ids == (0, 2) and tok.eos_id == 0  # generation_config's id first, then eos_token
    assert tok.chat_template == "D"
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    assert tokenizer_lib.load(str(directory)).chat_template == "{{ messages }}"


def test_tokenizer_with_more_pieces_than_the_model_is_refused(hf_path):
    tok = tokenizer_lib.load(hf_path)
    tokenizer_lib.check_vocab(tok, 320)
    tokenizer_lib.check_vocab(tok, 512)  # fewer pieces than the model's vocabulary is fine
    with pytest.raises(DataError, match=rf"the tokenizer {hf_path} has 320 pieces but vocab_size=300: .* Set "
                                        r"vocab_size=320 or more \(e.g. 384, a multiple of 128\)"):
        tokenizer_lib.check_vocab(tok, 300)


def test_importing_the_data_package_loads_no_tokenizer_library():
    code = ("import sys, maxtrain.data, maxtrain.data.tokenizer, maxtrain.data.tokenizer_training; "
            "print(sorted(m for m in ('tokenizers', 'sentencepiece', 'jax', 'grain') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=h.REPO)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# Errors: one line, naming the file and the fix
# --------------------------------------------------------------------------------------------


def _error(path, key="tokenizer_path") -> str:
    with pytest.raises(DataError) as info:
        tokenizer_lib.load(str(path), key)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_paths_and_files(tmp_path, hf_path):
    message = _error(tmp_path / "nope.model")
    assert f"tokenizer_path='{tmp_path / 'nope.model'}' does not exist" in message
    assert "Hugging Face tokenizer.json" in message and "train_tokenizer.py" in message
    assert f"--tokenizer '{tmp_path / 'nope'}' does not exist" in _error(tmp_path / "nope", "--tokenizer")

    (tmp_path / "empty").mkdir()
    message = _error(tmp_path / "empty")
    assert f"tokenizer_path='{tmp_path / 'empty'}' is a directory without tokenizer.json or tokenizer.model. " in message
    assert "download its tokenizer files" in message
    (tmp_path / "empty" / "tokenizer").mkdir()
    assert f"without tokenizer.json or tokenizer.model (is it {tmp_path / 'empty' / 'tokenizer'}?)" in _error(
        tmp_path / "empty")

    truncated = tmp_path / "truncated" / "tokenizer.json"
    _write(truncated.parent, {"tokenizer.json": open(os.path.join(hf_path, "tokenizer.json")).read()[:5000]})
    message = _error(truncated.parent)
    assert f"{truncated} is not valid JSON" in message and "a damaged or truncated tokenizer.json" in message
    assert "Download it again" in message

    config = tmp_path / "tokenizer_config.json"
    config.write_text(open(os.path.join(hf_path, "tokenizer_config.json")).read())
    assert f"{config} has no 'model' section, so it is not a tokenizer.json" in _error(config)

    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "NoSuchModel"}}')
    message = _error(broken)
    assert f"{broken} cannot be read by tokenizers" in message and "pip install -U tokenizers" in message


def test_model_files_that_are_not_sentencepiece(tmp_path):
    junk = tmp_path / "junk.model"
    junk.write_bytes(bytes(range(7, 250)) * 4)
    message = _error(junk)
    assert f"{junk} is not a sentencepiece model" in message and "Hugging Face tokenizer.json" in message
    tiktoken = tmp_path / "llama3-original" / "tokenizer.model"
    tiktoken.parent.mkdir()
    tiktoken.write_text("IQ== 0\nIg== 1\nIw== 2\n")
    message = _error(tiktoken.parent)
    assert f"{tiktoken} is a tiktoken BPE file" in message and "Use the Hugging Face tokenizer.json" in message


def test_config_naming_a_token_the_vocabulary_lacks(hf_path, tmp_path):
    tokenizer_json = open(os.path.join(hf_path, "tokenizer.json")).read()
    for key, value in (("eos_token", "<|im_end|>"), ("bos_token", {"content": "<s>", "special": True}),
                       ("additional_special_tokens", ["<|pad|>", "<|tool|>"])):
        directory = _write(tmp_path / key, {"tokenizer.json": tokenizer_json, "tokenizer_config.json": {key: value}})
        message = _error(directory)
        content = value if isinstance(value, str) else value["content"] if isinstance(value, dict) else value[-1]
        assert f"{directory}/tokenizer_config.json: {key} names {content!r}, which is not in the vocabulary of " \
               f"{directory}/tokenizer.json" in message
        assert "Change it to one of the tokenizer's tokens (or null)" in message
    directory = _write(tmp_path / "generation", {"tokenizer.json": tokenizer_json,
                                                  "generation_config.json": {"eos_token_id": [2, 320]}})
    message = _error(directory)
    assert f"{directory}/generation_config.json: eos_token_id 320 is not a token id of this tokenizer (it has 320 " \
           "pieces)" in message
    directory = _write(tmp_path / "bad_json", {"tokenizer.json": tokenizer_json, "tokenizer_config.json": "{'bos'"})
    assert f"{directory}/tokenizer_config.json is not valid JSON" in _error(directory)


def test_train_tokenizer_script_refuses_a_file_name_for_a_directory(tmp_path):
    h.write_jsonl(str(tmp_path / "a.jsonl"), h.texts(20))
    result = subprocess.run([sys.executable, os.path.join(h.REPO, "scripts", "train_tokenizer.py"), "--kind", "hf",
                             "--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "tok.model")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and not os.path.exists(tmp_path / "tok.model")
    assert result.stderr.strip() == (f"train_tokenizer: error: --kind hf writes a directory (tokenizer.json, "
                                     f"tokenizer_config.json, special_tokens_map.json), but --output "
                                     f"'{tmp_path / 'tok.model'}' names a file. Give a directory, e.g. --output "
                                     f"{tmp_path / 'tok'}/")


# --------------------------------------------------------------------------------------------
# Training with either kind
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_on_the_default_corpus_with_a_hugging_face_tokenizer(tiny_args, hf_path, capsys):
    """320 pieces under a 512-id model: training, eval and the closing sample (whose ids may be past the tokenizer)
    work; a tokenizer larger than vocab_size is refused before the first step."""
    from maxtrain import train  # pylint: disable=import-outside-toplevel


    args = with_overrides(tiny_args, f"tokenizer_path={hf_path}", "default_corpus_max_mb=0.2", "steps=2",
                          "eval_interval=2", "eval_steps=1", "max_new_tokens=8", "viz_period=-1",
                          "enable_checkpointing=false")
    result = train.main(args)
    assert set(result.eval_losses) == {0, 2} and result.sample.startswith("def main(")
    assert "greedy sample from 'def main('" in capsys.readouterr().out
    with pytest.raises(DataError, match=rf"the tokenizer {hf_path} has 320 pieces but vocab_size=256"):
        train.main(with_overrides(args, "vocab_size=256"))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "maxtrain.train", "configs/base.yml", f"tokenizer_path={tmp_path}",
                             f"base_output_directory={tmp_path}/out"],
                            capture_output=True, text=True, timeout=120, check=False, cwd=h.REPO, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"maxtrain: error: tokenizer_path='{tmp_path}' is a directory without tokenizer.json or tokenizer.model."
        f" Give {tokenizer_lib.ACCEPTS}; for a Hugging Face model, download its tokenizer files too (tokenizer.json, "
        "tokenizer_config.json, generation_config.json)"]

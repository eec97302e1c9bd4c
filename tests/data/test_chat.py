"""Chat templates rendered as transformers renders them; loss weights on assistant tokens; bad records."""

import json

import numpy as np
import pytest

from maxtrain.data import chat
from maxtrain.data.errors import DataError

# A template in the style of real ones: a system default, raise_exception, tojson, loop controls.
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}{% endif %}"
    "<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "{% if loop.index0 > 50 %}{% break %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{% if message.meta %} {{ message.meta | tojson }}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

MESSAGES = [{"role": "system", "content": "Be brief. \u00e9"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"}]


class CharTokenizer:
    """One id per character, with the ChatML markers as single ids (enough to check the weights)."""

    SPECIAL = ["<s>", "<|im_start|>", "<|im_end|>"]

    def __init__(self, template=None):
        self.chat_template, self.bos_id, self.eos_id, self.pad_id, self.path = template, 0, 2, None, "<chars>"

    def piece(self, i):
        return self.SPECIAL[i] if i < len(self.SPECIAL) else chr(i)

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            for j, s in enumerate(self.SPECIAL):
                if text.startswith(s, i):
                    ids.append(j)
                    i += len(s)
                    break
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        return "".join(self.piece(int(i)) for i in ids)


def _hf_tokenizer(template):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "[UNK]": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                                unk_token="[UNK]", chat_template=template)


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:3], MESSAGES[:2]])
def test_rendering_matches_transformers_apply_chat_template(messages, generation_prompt):
    hf = _hf_tokenizer(TEMPLATE)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    ours = chat.Template(TEMPLATE, CharTokenizer(TEMPLATE)).render(messages, generation_prompt)
    assert ours == want


@pytest.mark.parametrize("name", sorted(chat.BUILTIN_TEMPLATES))
def test_builtin_templates_render_as_transformers_does(name):
    hf = _hf_tokenizer(chat.BUILTIN_TEMPLATES[name])
    for generation_prompt in (False, True):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert chat.template_for(CharTokenizer(), name).render(MESSAGES, generation_prompt) == want


def test_tojson_and_raise_exception_behave_as_in_transformers():
    hf = _hf_tokenizer(TEMPLATE)
    meta = [{"role": "user", "content": "x", "meta": {"b": [1, "\u00e9"], "a": None}}, {"role": "assistant", "content": "y"}]
    assert chat.Template(TEMPLATE, CharTokenizer()).render(meta) == hf.apply_chat_template(meta, tokenize=False)
    assert json.dumps({"b": [1, "\u00e9"], "a": None}, ensure_ascii=False) in chat.render(TEMPLATE, meta)
    with pytest.raises(DataError, match="bad role tool"):
        chat.Template(TEMPLATE, CharTokenizer()).render([{"role": "tool", "content": "x"}])


def test_weights_fall_on_assistant_tokens_only():
    tok = CharTokenizer(TEMPLATE)
    template = chat.template_for(tok)
    element = chat.sft_element(template, MESSAGES, completion_only=True)
    ids, weights = element["tokens"], element["weights"]
    assert tok.decode(ids) == template.render(MESSAGES)  # the tokens are the rendered text
    weighted = "".join(tok.piece(int(i)) for i, w in zip(ids, weights) if w)
    assert weighted == "4<|im_end|>\n6<|im_end|>\n"  # each assistant reply and its end-of-turn marker
    everything = chat.sft_element(template, MESSAGES, completion_only=False)["weights"]
    assert everything[0] == 0 and everything[1:].all()


def test_builtin_template_puts_the_bos_id_first_for_tokenizers_that_have_one():
    tok = CharTokenizer()
    element = chat.sft_element(chat.template_for(tok, "chatml"), MESSAGES[1:3], True)
    assert element["tokens"][0] == tok.bos_id and element["weights"][0] == 0


def test_dpo_element_signs_and_restarting_positions():
    tok = CharTokenizer()
    template = chat.template_for(tok, "plain")
    prompt, chosen, rejected = chat.preference({"p": "1+1=", "c": "2", "r": "3x"}, ["p", "c", "r"], "row 0")
    element = chat.dpo_element(template, prompt, chosen, rejected)
    first = element["parts"] == 1
    assert "".join(tok.piece(int(i)) for i, w in zip(element["tokens"], element["weights"]) if w > 0) == "2\n"
    assert "".join(tok.piece(int(i)) for i, w in zip(element["tokens"], element["weights"]) if w < 0) == "3x\n"
    assert element["positions"][~first][0] == 0 and element["positions"][first][-1] == first.sum() - 1
    cut, was_cut = chat.truncate(element, 10)
    assert was_cut and len(cut["tokens"]) == 10 and (cut["parts"] == 1).sum() == 5


def test_template_that_rewrites_earlier_turns_is_refused():
    # Drops earlier assistant replies once a later one exists: the turn-by-turn renderings disagree.
    rewriting = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match="rewrites earlier turns"):
        chat.sft_element(chat.Template(rewriting, CharTokenizer()), MESSAGES[1:], True, "f.jsonl line 3")


@pytest.mark.parametrize("record, match", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "unknown role 'human'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "yo"}]}, "content of type int"),
    ({"text": "hi"}, r"no 'messages' field \(the record has: text\)\. Name the fields with train_data_columns="),
    ({"messages": []}, "non-empty list"),
])
def test_bad_conversations_name_the_record_and_the_fix(record, match):
    with pytest.raises(DataError, match=match) as e:
        chat.conversation(record, ["messages"], "data.jsonl line 7")
    assert "data.jsonl line 7" in str(e.value)


def test_dpo_row_missing_rejected_is_refused():
    with pytest.raises(DataError, match="'rejected' is missing"):
        chat.preference({"prompt": "p", "chosen": "c"}, ["prompt", "chosen", "rejected"], "prefs.jsonl line 2")


def test_tokenizer_without_template_and_no_named_template_is_refused():
    with pytest.raises(DataError, match="has no chat template.*chat_template to a built-in one"):
        chat.template_for(CharTokenizer(None), "")
    assert chat.template_for(CharTokenizer(TEMPLATE), "").builtin is None
    assert np.all(chat.template_for(CharTokenizer(None), "chatml").text == chat.BUILTIN_TEMPLATES["chatml"])


def test_hf_tokenizer_directory_with_its_own_template_gives_transformers_ids(tmp_path):
    """tokenizer_path=<HF directory>: its chat_template is used, and the ids equal apply_chat_template's."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from maxtrain.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

    chars = sorted(set("".join(m["content"] for m in MESSAGES) + "systemuserassistant\nYouarehlpf. "))
    vocab = {"<s>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "[UNK]": 3, **{c: 4 + i for i, c in enumerate(chars)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # one token per character
    backend.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                              unk_token="[UNK]", chat_template=TEMPLATE)
    hf.save_pretrained(tmp_path)
    tok = tokenizer_lib.load(str(tmp_path))
    template = chat.template_for(tok)  # no chat_template key: the tokenizer's own
    assert template.builtin is None and tok.chat_template == TEMPLATE
    element = chat.sft_element(template, MESSAGES, completion_only=True)
    want = hf.apply_chat_template(MESSAGES, tokenize=True)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
    assert element["tokens"].tolist() == want
    weighted = "".join(tok.piece(int(i)) for i in element["tokens"][element["weights"] > 0])
    assert weighted == "4<|im_end|>\n6<|im_end|>\n"

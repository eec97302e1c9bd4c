"""Chat templates, and conversations / preference pairs as token ids with loss weights.

Rendering. A chat template is a Jinja string (tokenizer_config.json's `chat_template`, or
chat_template.jinja) rendered as transformers renders it: a sandboxed Jinja environment with
trim_blocks, lstrip_blocks and the loop-control extension, the `tojson` filter, the
`raise_exception` and `strftime_now` globals, and the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `pad_token`, `unk_token`. The text is then
tokenized without adding special tokens, as apply_chat_template does: what the template writes
(a BOS string included) is what the model sees. Tokenizers without a template take a built-in one
named by `chat_template` (chatml, llama3, plain); with those, the tokenizer's BOS id (if any) is
put first.

Loss weights. The conversation is rendered turn by turn: for the i-th assistant message the text
up to it with the generation prompt (`<|im_start|>assistant\\n`) and the text through it are
rendered, and the difference is the assistant's part: its tokens carry weight 1 with
sft_train_on_completion_only (every token does without it). Each part is tokenized on its own
and the ids joined, so a token never straddles a turn boundary. A template whose renderings do
not extend one another (one that rewrites earlier turns) cannot be split this way, and is
refused with a message saying so.

DPO. A preference row (prompt, chosen, rejected) becomes two sequences, prompt + chosen and
prompt + rejected, kept together as one packing element: the chosen completion's tokens carry
weight +1, the rejected one's -1 (training/losses.dpo reads the sign), prompts 0.
"""

from __future__ import annotations

import datetime
import functools
import json

import numpy as np

from maxtrain.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool")

BUILTIN_TEMPLATES = {
    # ChatML (Qwen, many others): <|im_start|>role\ncontent<|im_end|>\n
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
    # Llama 3's header format (without its date preamble)
    "llama3": ("{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
               "message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    # Plain text for tokenizers without special tokens: "User: ...\nAssistant: ...\n"
    "plain": ("{% for message in messages %}{{ message['role'] | capitalize + ': ' + message['content'] + '\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"),
}


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _raise_exception(message):
    from jinja2.exceptions import TemplateError  # pylint: disable=import-outside-toplevel

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.datetime.now().strftime(format_string)


@functools.lru_cache(maxsize=16)
def compile_template(template: str):
    """The Jinja template object, in transformers' environment."""
    try:
        import jinja2.ext  # pylint: disable=import-outside-toplevel
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise DataError("chat templates need jinja2: pip install jinja2 (it comes with maxtrain[post])") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise DataError(f"the chat template is not valid Jinja ({e}); fix it, or set chat_template to a built-in one "
                        f"({', '.join(BUILTIN_TEMPLATES)})") from None


def render(template: str, messages: list[dict], add_generation_prompt: bool = False, special: dict | None = None) -> str:
    """The text of `messages` under `template` (transformers' apply_chat_template(tokenize=False))."""
    from jinja2 import TemplateError  # pylint: disable=import-outside-toplevel

    try:
        return compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **(special or {}))
    except TemplateError as e:
        raise DataError(f"the chat template refused a conversation: {e}") from None


class Template:
    """A chat template with the tokenizer it renders for."""

    def __init__(self, text: str, tokenizer, builtin: str | None = None):
        self.text, self.tokenizer, self.builtin = text, tokenizer, builtin
        self.special = {name: _token_text(tokenizer, getattr(tokenizer, f"{name}_id", None))
                        for name in ("bos", "eos", "pad")}
        self.special = {f"{k}_token": v for k, v in self.special.items() if v is not None}
        compile_template(text)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return render(self.text, messages, add_generation_prompt, self.special)

    def describe(self) -> str:
        return f"built-in {self.builtin}" if self.builtin else f"the tokenizer's ({getattr(self.tokenizer, 'path', '')})"


def _token_text(tokenizer, token_id):
    return None if token_id is None else tokenizer.piece(token_id)


def template_for(tokenizer, name: str = "") -> Template:
    """The named built-in template, else the tokenizer's own; a clear error when there is neither."""
    if name:
        if name not in BUILTIN_TEMPLATES:
            raise DataError(f"chat_template={name!r} is not a built-in template; use one of {', '.join(BUILTIN_TEMPLATES)}")
        return Template(BUILTIN_TEMPLATES[name], tokenizer, name)
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        raise DataError(f"the tokenizer {getattr(tokenizer, 'path', '')} has no chat template (no chat_template in its "
                        "tokenizer_config.json, no chat_template.jinja). Set chat_template to a built-in one: "
                        f"{', '.join(BUILTIN_TEMPLATES)} (chatml needs no special tokens in the vocabulary to work, "
                        "but learns faster with <|im_start|> and <|im_end|> as single tokens)")
    return Template(own, tokenizer)


# --------------------------------------------------------------------------------------------
# Records -> messages
# --------------------------------------------------------------------------------------------


def check_messages(messages, where: str, need_assistant: bool = True) -> list[dict]:
    """The messages as plain dicts {role, content}, or a DataError naming the record and the fix."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects, got "
                        f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has an unknown role {m['role']!r}; roles are {', '.join(ROLES)}. "
                            "Rename it in the data (e.g. 'human' -> 'user', 'gpt' -> 'assistant')")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {i} ({m['role']}) has content of type {type(m['content']).__name__}; "
                            "it must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing would be learned from it. Add the "
                        "assistant's reply, or remove the record")
    return out


def _as_messages(value, role: str, where: str, column: str) -> list[dict]:
    """A prompt/completion column: a string (one message of `role`) or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, (list, tuple)):
        return check_messages(value, f"{where} column {column!r}", need_assistant=False)
    raise DataError(f"{where}: column {column!r} must be a string or a list of messages, got "
                    f"{'nothing' if value is None else type(value).__name__}")


def conversation(record: dict, columns: list[str], where: str, key: str = "train_data_columns") -> list[dict]:
    """The messages of an SFT record: columns [messages] or [prompt, completion] (`key` names them: the
    train_data_columns or eval_data_columns of the record's split)."""
    missing = [c for c in columns if c not in record or record[c] is None]
    if missing:
        raise DataError(f"{where}: no {', '.join(map(repr, missing))} field (the record has: "
                        f"{', '.join(map(str, record)) or 'no fields'}). Name the fields with {key}=[messages] or "
                        f"{key}=[prompt,completion] (your names), or fix the record")
    if len(columns) == 1:
        return check_messages(record[columns[0]], where)
    prompt = _as_messages(record[columns[0]], "user", where, columns[0])
    completion = _as_messages(record[columns[1]], "assistant", where, columns[1])
    return check_messages(prompt + completion, where)


def preference(record: dict, columns: list[str], where: str,
               key: str = "train_data_columns") -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen messages, rejected messages) of a DPO record [prompt, chosen, rejected]
    (`key`: as conversation's)."""
    missing = [c for c in columns if c not in record or record[c] is None]
    if missing:
        raise DataError(f"{where}: a DPO row needs {columns[0]!r}, {columns[1]!r} and {columns[2]!r}, but "
                        f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} missing (the record has:"
                        f" {', '.join(map(str, record)) or 'no fields'}). Fix the row, or name the fields with "
                        f"{key}=[prompt,chosen,rejected] (your names)")
    prompt = _as_messages(record[columns[0]], "user", where, columns[0])
    chosen = _as_messages(record[columns[1]], "assistant", where, columns[1])
    rejected = _as_messages(record[columns[2]], "assistant", where, columns[2])
    for name, side in ((columns[1], chosen), (columns[2], rejected)):
        if not any(m["role"] == "assistant" for m in side):
            raise DataError(f"{where}: {name!r} holds no assistant message; it must be the assistant's reply")
    return prompt, chosen, rejected


# --------------------------------------------------------------------------------------------
# Messages -> ids and weights
# --------------------------------------------------------------------------------------------


def parts(template: Template, messages: list[dict], completion_only: bool, where: str = "") -> list[tuple[str, bool]]:
    """The conversation's text cut into (text, carries loss) parts, in order."""
    full = template.render(messages)
    out, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[:i + 1])
        if not (through.startswith(before) and full.startswith(through) and len(before) >= done):
            raise DataError(f"{where}: the chat template {template.describe()} does not render this conversation as "
                            "its turns one after another (it rewrites earlier turns), so the assistant's tokens cannot "
                            "be found. Set chat_template to a built-in one (" + ", ".join(BUILTIN_TEMPLATES) + ") or "
                            "use a template whose renderings extend one another")
        out.append((full[done:len(before)], not completion_only))
        out.append((through[len(before):], True))
        done = len(through)
    out.append((full[done:], not completion_only))
    return [(text, loss) for text, loss in out if text]


def encode_parts(template: Template, text_parts: list[tuple[str, bool]], sign: float = 1.0):
    """(int32 tokens [n], float32 weights [n]): weights[j] is the loss weight of predicting token j."""
    tok = template.tokenizer
    ids: list[int] = []
    weights: list[float] = []
    bos = getattr(tok, "bos_id", None)
    if template.builtin and bos is not None:
        ids.append(bos)
        weights.append(0.0)
    for text, loss in text_parts:
        piece = tok.encode(text)
        ids.extend(piece)
        weights.extend([sign if loss else 0.0] * len(piece))
    if weights:
        weights[0] = 0.0  # the first token is never a target
    return np.asarray(ids, np.int32), np.asarray(weights, np.float32)


def sft_element(template: Template, messages: list[dict], completion_only: bool, where: str = "") -> dict:
    """One packing element: tokens, weights, parts (all 1) and positions."""
    tokens, weights = encode_parts(template, parts(template, messages, completion_only, where))
    if not weights.any():
        raise DataError(f"{where}: the conversation renders to no assistant tokens under the chat template "
                        f"{template.describe()}; check its messages")
    n = len(tokens)
    return {"tokens": tokens, "weights": weights, "parts": np.ones(n, np.int32), "positions": np.arange(n, dtype=np.int32)}


def dpo_element(template: Template, prompt, chosen, rejected, where: str = "") -> dict:
    """One packing element holding both sequences of a pair: part 1 = prompt + chosen (+1 weights),
    part 2 = prompt + rejected (-1 weights); positions restart at the second."""
    c_tokens, c_weights = encode_parts(template, parts(template, prompt + chosen, True, where), 1.0)
    r_tokens, r_weights = encode_parts(template, parts(template, prompt + rejected, True, where), -1.0)
    return {"tokens": np.concatenate([c_tokens, r_tokens]), "weights": np.concatenate([c_weights, r_weights]),
            "parts": np.concatenate([np.ones(len(c_tokens), np.int32), np.full(len(r_tokens), 2, np.int32)]),
            "positions": np.concatenate([np.arange(len(c_tokens)), np.arange(len(r_tokens))]).astype(np.int32)}


def truncate(element: dict, length: int) -> tuple[dict, bool]:
    """The element cut to at most `length` tokens (a DPO pair: each sequence to half); whether it was cut."""
    if len(element["tokens"]) <= length:
        return element, False
    if element["parts"].max() == 1:
        return {k: v[:length] for k, v in element.items()}, True
    half = length // 2
    first = element["parts"] == 1
    keep = np.concatenate([np.flatnonzero(first)[:half], np.flatnonzero(~first)[:half]])
    return {k: v[keep] for k, v in element.items()}, True
